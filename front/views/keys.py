"""The API keys page. A new key's secret is rendered into the response that creates it and
kept nowhere else: no redirect, no flash message stored in the session."""

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from accounts import selectors, services
from endpoints.selectors import endpoints_of
from front.forms import APIKeyForm
from front.scoping import Member, membership
from kvrun.common.forms import add_service_errors


def _key_form(member: Member, data: object = None) -> APIKeyForm:
    return APIKeyForm(data, endpoints=endpoints_of(organization=member.organization))


@login_required
def api_keys(request: HttpRequest, org_slug: str, form: APIKeyForm | None = None,
             created: dict | None = None, status: int = 200) -> HttpResponse:
    member = membership(request, org_slug)
    return render(request, "front/keys.html", {
        "member": member, "organization": member.organization, "created": created or {},
        "section": "keys",
        "api_keys": selectors.api_keys_of(organization=member.organization)
        .order_by("-created_at"),
        "playground_keys": (selectors.playground_keys_of(organization=member.organization)
                            if member.manages else []),
        "key_form": form or _key_form(member),
        "default_limits": {"requests": settings.KVRUN_KEY_REQUESTS_PER_MINUTE,
                           "tokens": settings.KVRUN_KEY_TOKENS_PER_MINUTE},
    }, status=status)


@login_required
@require_POST
@never_cache  # the response carries the new secret
def create_api_key(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = membership(request, org_slug)
    form = _key_form(member, request.POST)
    if not form.is_valid():
        return api_keys(request, org_slug, form=form, status=400)
    try:
        key, secret = services.do_create_api_key(
            organization=member.organization, created_by=request.user, actor_role=member.role,
            **form.cleaned_data)
    except ValidationError as exc:
        add_service_errors(form, exc)
        if getattr(exc, "code", None) == services.KEY_FORM_SENT_AGAIN:
            # Shown again, it is a new form: its own token, or every send would be refused.
            form.data = form.data.copy()
            form.data["creation_token"] = form.fields["creation_token"].initial
        return api_keys(request, org_slug, form=form, status=400)
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("api-keys", org_slug=org_slug)
    return api_keys(request, org_slug, created={"key": key, "secret": secret})


@login_required
@require_POST
def revoke_api_key(request: HttpRequest, org_slug: str, key_id: str) -> HttpResponse:
    member = membership(request, org_slug)
    key = get_object_or_404(selectors.api_keys_of(organization=member.organization), id=key_id)
    try:
        services.do_revoke_api_key(key=key, actor_role=member.role)
        messages.success(request, f"Key {key.name} ({key.masked}) is revoked.")
    except PermissionDenied as exc:
        messages.error(request, str(exc))
    return redirect("api-keys", org_slug=org_slug)
