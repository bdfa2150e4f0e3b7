"""The organisation page: members, roles and invites. An invite link is rendered into the
response that creates it and kept nowhere else."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from accounts import selectors, services
from accounts.models import Membership, Role
from front.forms import InviteForm
from front.scoping import Member, membership


@login_required
def organization(request: HttpRequest, org_slug: str, invite_form: InviteForm | None = None,
                 created: dict | None = None, status: int = 200) -> HttpResponse:
    member = membership(request, org_slug)
    memberships = list(selectors.memberships_of(organization=member.organization)
                       .order_by("created_at"))
    return render(request, "front/organization.html", {
        "member": member, "organization": member.organization, "created": created or {},
        "section": "organization", "memberships": memberships,
        # The only owner cannot leave (do_remove_member says so): no button that can only fail.
        "sole_owner": sum(m.role == Role.OWNER for m in memberships) == 1,
        "invites": selectors.invites_of(organization=member.organization)
        .order_by("-created_at")[:20],
        "invite_form": invite_form or InviteForm(), "roles": Role.choices,
    }, status=status)


@login_required
@require_POST
@never_cache  # the response carries the invite link
def create_invite(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = membership(request, org_slug)
    form = InviteForm(request.POST)
    if not form.is_valid():
        return organization(request, org_slug, invite_form=form, status=400)
    try:
        invite, token = services.do_create_invite(
            organization=member.organization, created_by=request.user, actor_role=member.role,
            **form.cleaned_data)
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("organization", org_slug=org_slug)
    return organization(request, org_slug, created={"invite": invite,
                                                    "invite_url": services.invite_url(token)})


@login_required
@require_POST
def change_role(request: HttpRequest, org_slug: str, user_id: int) -> HttpResponse:
    member = membership(request, org_slug)
    target = _membership_of(member, user_id)
    role = request.POST.get("role", "")
    if role not in Role.values:
        messages.error(request, f"Choose a role: {', '.join(Role.values)}.")
        return redirect("organization", org_slug=org_slug)
    try:
        services.do_change_member_role(membership=target, role=role, actor_role=member.role)
        messages.success(request, f"{target.user.email} is now {role}.")
    except (PermissionDenied, ValidationError) as exc:
        messages.error(request, _refusal(exc))
    return redirect("organization", org_slug=org_slug)


@login_required
@require_POST
def remove_member(request: HttpRequest, org_slug: str, user_id: int) -> HttpResponse:
    member = membership(request, org_slug)
    target = _membership_of(member, user_id)
    try:
        services.do_remove_member(membership=target, actor=request.user, actor_role=member.role)
    except (PermissionDenied, ValidationError) as exc:
        messages.error(request, _refusal(exc))
        return redirect("organization", org_slug=org_slug)
    if target.user_id == request.user.pk:
        messages.success(request, f"You left {member.organization.name}.")
        return redirect("dashboard")
    messages.success(request, f"{target.user.email} is no longer a member.")
    return redirect("organization", org_slug=org_slug)


def _membership_of(member: Member, user_id: int) -> Membership:
    """A membership of the page's organisation; 404 for anyone else's."""
    return get_object_or_404(selectors.memberships_of(organization=member.organization),
                             user_id=user_id)


def _refusal(exc: PermissionDenied | ValidationError) -> str:
    return " ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
