"""What the dashboard's views share: an endpoint's page, and the changes made from it, each
saying how it went on that page. No view module imports another; they import this."""

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from accounts.services import require_manager
from billing.selectors import month_to_date_by_endpoint, window_costs
from endpoints.models import Endpoint
from endpoints.planning import accelerator_of
from endpoints.selectors import replicas_behind_parsers
from front import presenters
from front.forms import AdapterForm, AdapterUploadForm, PolicyForm, ScalingForm
from front.scoping import Member, endpoint_of, membership
from kvrun.common.forms import add_service_errors
from telemetry.models import Advice

SettingsForm = ScalingForm | PolicyForm | AdapterForm | AdapterUploadForm
# Where the page shows each form (a refused one as it was sent).
FORM_NAMES = {ScalingForm: "scaling_form", PolicyForm: "policy_form",
              AdapterForm: "adapter_form", AdapterUploadForm: "upload_form"}


def endpoint_page(request: HttpRequest, member: Member, endpoint: Endpoint, *,
                  refused: SettingsForm | None = None, status: int = 200) -> HttpResponse:
    """The endpoint's page; with a form that was refused, that form as sent."""
    forms = {"policy_form": PolicyForm.of(endpoint), "scaling_form": ScalingForm.of(endpoint),
             "adapter_form": AdapterForm(), "upload_form": AdapterUploadForm()}
    if refused is not None:
        forms[FORM_NAMES[type(refused)]] = refused
    gateway = settings.KVRUN_GATEWAY_URL
    device = accelerator_of(endpoint.gpu_type).memory_bytes
    sized = "weight_bytes_per_gpu" in endpoint.sizing  # absent only on hand-made rows
    costs = {label: window_costs(endpoint_ids=[endpoint.id], hours=hours)[endpoint.id]
             for label, hours in (("hour", 1), ("day", 24))}
    month = month_to_date_by_endpoint(organization=member.organization).get(endpoint.id, 0)
    return render(request, "front/endpoint.html", {
        "costs": costs, "month_cents": month,
        "advice": Advice.objects.filter(endpoint=endpoint, resolved_at=None),
        **forms, "adapters": presenters.adapters(endpoint),
        "memory": presenters.memory_bar(endpoint.sizing, device, task=endpoint.model.task)
        if sized else None,
        "device_bytes": device, "member": member, "organization": member.organization,
        "endpoint": endpoint, "section": "endpoints",
        "status": presenters.endpoint_status(endpoint),
        "gateway": gateway,
        "snippets": presenters.snippets(endpoint.name, gateway, endpoint.model.task),
        "replicas_behind_parsers": replicas_behind_parsers(endpoint=endpoint),
    }, status=status)


def change_endpoint(request: HttpRequest, org_slug: str, name: str,
                    change: Callable[[Member, Endpoint], str]) -> HttpResponse:
    """Run `change` on the endpoint and say how it went on the endpoint's page; refusals
    (a role that may not, a value out of range) are shown, not raised."""
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    try:
        messages.success(request, change(member, endpoint))
    except PermissionDenied as exc:
        messages.error(request, str(exc))
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    return redirect("endpoint", org_slug=org_slug, name=name)


def change_settings(request: HttpRequest, org_slug: str, name: str, form: SettingsForm,
                    change: Callable[[Member, Endpoint, dict[str, Any]], str]) -> HttpResponse:
    """Run `change` with a settings form's values and say how it went on the endpoint's page.
    A role that may not is said at the top, whatever it sent; a refused value shows the page
    again with the form as sent, each error under its field (a service's too)."""
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    try:
        require_manager(member.role, "change endpoints")
        if form.is_valid():
            messages.success(request, change(member, endpoint, form.cleaned_data))
            return redirect("endpoint", org_slug=org_slug, name=name)
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("endpoint", org_slug=org_slug, name=name)
    except ValidationError as exc:
        add_service_errors(form, exc)
    return endpoint_page(request, member, endpoint, refused=form, status=400)
