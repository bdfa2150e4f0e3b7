"""Account pages: sign-up, confirming an email address, the lock-out page, the
password-reset request, accepting an invite. Sign-in, sign-out, the password change and the
rest of the reset are Django's own views (accounts.page_urls)."""

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import PasswordResetForm
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from accounts import services
from accounts.api import SignUpThrottle
from accounts.forms import SignUpForm
from accounts.models import Invite
from kvrun.common.clients import client_address
from kvrun.common.digests import secret_digest
from kvrun.common.forms import add_service_errors

# Reset requests a client address may make an hour; and reset mails one email address may
# be sent an hour, from every address together: enough that no stranger can keep a person's
# reset from them for long, few enough that nobody floods an inbox.
PASSWORD_RESETS_PER_HOUR = 5
PASSWORD_RESET_MAILS_PER_HOUR = 20
# Confirmation mails a person may have sent again an hour.
VERIFICATION_MAILS_PER_HOUR = 5


def lockout(request: HttpRequest, credentials: dict | None = None, *args: object,
            **kwargs: object) -> HttpResponse:
    """Shown by django-axes after too many failed sign-ins for an account or an address."""
    minutes = round(settings.AXES_COOLOFF_TIME * 60)
    message = f"Too many failed sign-in attempts. Wait {minutes} minutes, then try again."
    if request.path.startswith("/api/"):
        return JsonResponse({"error": {"type": "locked_out", "message": message, "fields": {}}},
                            status=429)
    return render(request, "accounts/locked_out.html", {"message": message}, status=429)


def sign_up(request: HttpRequest) -> HttpResponse:
    form = SignUpForm(request.POST or None)
    next_url = request.POST.get("next") or request.GET.get("next", "")
    if request.method == "POST" and not SignUpThrottle().allow_request(request, None):
        form.add_error(None, "Too many sign-ups from your address; wait an hour, then try again.")
        return render(request, "accounts/signup.html", {"form": form, "next": next_url},
                      status=429)
    if request.method == "POST" and form.is_valid():
        try:
            user = services.do_sign_up(**form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            # Where sign-in was asked for (the wizard, from make run's first line), if ours.
            if url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
                return redirect(next_url)
            return redirect("dashboard")
    status = 400 if request.method == "POST" else 200
    return render(request, "accounts/signup.html", {"form": form, "next": next_url},
                  status=status)


def verify_email(request: HttpRequest, token: str) -> HttpResponse:
    """The link mailed at sign-up. It works signed in or not: mail is often read elsewhere."""
    try:
        user = services.do_verify_email(token=token)
    except ValidationError as exc:
        return render(request, "accounts/verify_email.html", {"errors": exc.messages},
                      status=400)
    return render(request, "accounts/verify_email.html", {"confirmed": user.email})


@login_required
@require_POST
def send_email_verification(request: HttpRequest) -> HttpResponse:
    user = request.user
    if user.email_verified_at is not None:  # type: ignore[union-attr]
        messages.info(request, "Your email address is confirmed already.")
    elif not _within_hourly_limit(f"email-verification:{user.pk}",
                                  VERIFICATION_MAILS_PER_HOUR):
        messages.error(request, "Too many confirmation mails sent this hour; use the last "
                                "one, or wait an hour and ask again.")
    else:
        services.do_send_email_verification(user=user)  # type: ignore[arg-type]
        messages.success(request, f"A new confirmation link is on its way to {user.email}.")
    next_url = request.POST.get("next", "")
    if url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
        return redirect(next_url)
    return redirect("dashboard")


class PasswordResetView(auth_views.PasswordResetView):
    """Django's reset form, limited per client address (PASSWORD_RESETS_PER_HOUR: that
    address is told, with a 429) and per email address (PASSWORD_RESET_MAILS_PER_HOUR: past
    it, no mail is sent, and the answer is the one every request gets, so that it says
    neither whether the address has an account nor how often it was asked for)."""

    template_name = "accounts/password_reset.html"
    email_template_name = "accounts/password_reset_email.txt"
    subject_template_name = "accounts/password_reset_subject.txt"
    success_url = "/password/reset/sent/"

    def form_valid(self, form: PasswordResetForm) -> HttpResponse:
        if not _within_hourly_limit(f"password-reset:ip:{client_address(self.request)}",
                                    PASSWORD_RESETS_PER_HOUR):
            form.add_error("email", "Too many reset requests from your address; wait an "
                                    "hour, then try again.")
            return self.render_to_response(self.get_context_data(form=form), status=429)
        if not _within_hourly_limit(
                f"password-reset:email:{form.cleaned_data['email'].lower()}",
                PASSWORD_RESET_MAILS_PER_HOUR):
            return HttpResponseRedirect(self.get_success_url())
        return super().form_valid(form)


def _within_hourly_limit(name: str, most: int) -> bool:
    cache.add(name, 0, timeout=3600)
    return cache.incr(name) <= most


@login_required
def accept_invite(request: HttpRequest, token: str) -> HttpResponse:
    invite = (Invite.objects.select_related("organization")
              .filter(token_digest=secret_digest(token)).first())
    if request.method == "POST":
        try:
            membership = services.do_accept_invite(token=token, user=request.user)
        except ValidationError as exc:
            return render(request, "accounts/invite.html",
                          {"invite": invite, "errors": exc.messages}, status=400)
        messages.success(request, f"You joined {membership.organization.name}.")
        return redirect("endpoints", org_slug=membership.organization.slug)
    usable = invite is not None and invite.state == "pending"
    return render(request, "accounts/invite.html", {"invite": invite if usable else None},
                  status=200 if usable else 404)
