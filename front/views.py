"""The organisation page: its API keys, members and invites.

Secrets (a new API key, an invite link) are rendered into the response that creates
them and kept nowhere else: no redirect, no flash message stored in the session.
"""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from accounts import selectors, services
from accounts.models import Organization
from front.forms import APIKeyForm, InviteForm


def _current_organization(request: HttpRequest, slug: str | None) -> Organization | None:
    organizations = selectors.organizations_visible_to(principal=request.user).order_by("name")
    if slug:
        return get_object_or_404(organizations, slug=slug)
    return organizations.first()


@login_required
def dashboard(request: HttpRequest, org_slug: str | None = None,
              created: dict | None = None, status: int = 200) -> HttpResponse:
    organization = _current_organization(request, org_slug)
    context: dict = {"organization": organization, "created": created or {}}
    if organization is not None:
        context.update(
            organizations=selectors.organizations_visible_to(principal=request.user),
            role=selectors.role_of(principal=request.user, organization=organization),
            memberships=selectors.memberships_of(organization=organization).order_by("created_at"),
            invites=selectors.invites_of(organization=organization).order_by("-created_at")[:20],
            api_keys=selectors.api_keys_of(organization=organization).order_by("-created_at"),
            key_form=context["created"].get("key_form") or APIKeyForm(),
            invite_form=context["created"].get("invite_form") or InviteForm(),
        )
    return render(request, "front/organization.html", context, status=status)


@login_required
@require_POST
def create_api_key(request: HttpRequest, org_slug: str) -> HttpResponse:
    organization = _current_organization(request, org_slug)
    form = APIKeyForm(request.POST)
    if not form.is_valid():
        return dashboard(request, org_slug, created={"key_form": form}, status=400)
    try:
        key, secret = services.do_create_api_key(
            organization=organization, created_by=request.user,
            actor_role=selectors.role_of(principal=request.user, organization=organization),
            **form.cleaned_data,
        )
    except ValidationError as exc:
        for field, errors in exc.message_dict.items():
            form.add_error(field, errors)
        return dashboard(request, org_slug, created={"key_form": form}, status=400)
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("dashboard-org", org_slug=org_slug)
    return dashboard(request, org_slug, created={"key": key, "secret": secret})


@login_required
@require_POST
def revoke_api_key(request: HttpRequest, org_slug: str, key_id: str) -> HttpResponse:
    organization = _current_organization(request, org_slug)
    key = get_object_or_404(selectors.api_keys_of(organization=organization), id=key_id)
    try:
        services.do_revoke_api_key(
            key=key, actor_role=selectors.role_of(principal=request.user, organization=organization)
        )
        messages.success(request, f"Key {key.name} ({key.masked}) is revoked.")
    except PermissionDenied as exc:
        messages.error(request, str(exc))
    return redirect("dashboard-org", org_slug=org_slug)


@login_required
@require_POST
def create_invite(request: HttpRequest, org_slug: str) -> HttpResponse:
    organization = _current_organization(request, org_slug)
    form = InviteForm(request.POST)
    if not form.is_valid():
        return dashboard(request, org_slug, created={"invite_form": form}, status=400)
    try:
        invite, token = services.do_create_invite(
            organization=organization, created_by=request.user,
            actor_role=selectors.role_of(principal=request.user, organization=organization),
            **form.cleaned_data,
        )
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("dashboard-org", org_slug=org_slug)
    return dashboard(request, org_slug, created={"invite": invite,
                                                 "invite_url": services.invite_url(token)})


@login_required
@require_POST
def remove_member(request: HttpRequest, org_slug: str, user_id: int) -> HttpResponse:
    organization = _current_organization(request, org_slug)
    membership = get_object_or_404(selectors.memberships_of(organization=organization),
                                   user_id=user_id)
    try:
        services.do_remove_member(
            membership=membership, actor=request.user,
            actor_role=selectors.role_of(principal=request.user, organization=organization),
        )
        messages.success(request, f"{membership.user.email} is no longer a member.")
    except (PermissionDenied, ValidationError) as exc:
        messages.error(request, " ".join(getattr(exc, "messages", [str(exc)])))
    if membership.user_id == request.user.pk:
        return redirect("dashboard")
    return redirect("dashboard-org", org_slug=org_slug)
