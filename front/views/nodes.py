"""The organisation's own nodes: their health for every member, and join tokens for new
ones from its owners. A token's secret is rendered into the response that makes it and kept
nowhere else."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from accounts.models import Role
from endpoints.selectors import gpu_catalog, own_nodes_of
from fleet.enrolment import do_create_own_node_token
from fleet.forms import as_sentence
from front.forms import OwnNodeForm
from front.scoping import membership


@login_required
def own_nodes(request: HttpRequest, org_slug: str, form: OwnNodeForm | None = None,
              created: dict | None = None, status: int = 200) -> HttpResponse:
    member = membership(request, org_slug)
    return render(request, "front/nodes.html", {
        "member": member, "organization": member.organization, "section": "nodes",
        "nodes": own_nodes_of(organization=member.organization),
        "own_node_prices": [gpu for gpu in gpu_catalog() if gpu.own_node_price_usd],
        "owner": member.role == Role.OWNER, "form": form or OwnNodeForm(),
        "created": created or {}, "control_plane_url": request.build_absolute_uri("/"),
    }, status=status)


@login_required
@require_POST
@never_cache  # the response carries the join token
def create_own_node_token(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = membership(request, org_slug)
    form = OwnNodeForm(request.POST)
    if not form.is_valid():
        return own_nodes(request, org_slug, form=form, status=400)
    try:
        token, secret = do_create_own_node_token(
            organization=member.organization, actor_role=member.role, created_by=request.user,
            node_name=form.cleaned_data["node_name"], region=form.cleaned_data["region"],
            zone=form.cleaned_data["zone"] or "")
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("own-nodes", org_slug=org_slug)
    except ValueError as exc:
        form.add_error("node_name", as_sentence(exc))
        return own_nodes(request, org_slug, form=form, status=400)
    return own_nodes(request, org_slug, created={"token": token, "secret": secret})
