"""Endpoints: the list, one endpoint's page with its live status and charts, and the
actions on it (scale, stop, start, delete)."""

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from accounts.services import require_manager
from billing.selectors import (
    last_hour_totals,
    month_to_date_by_endpoint,
    usage_by_minute,
    window_costs,
)
from endpoints import selectors, services
from endpoints.models import Endpoint
from endpoints.planning import accelerator_of
from endpoints.states import COMING_UP, ENDPOINT_AT_REST, BilledPhase, State
from front.forms import PolicyForm, ScaleForm, ScalingForm
from front.scoping import Member, current_organization, endpoint_of, membership
from front.views.wizard import memory_bar
from kvrun.forms import add_service_errors
from telemetry.models import Advice

# Fewer rows than this per page keeps the list one screen on a laptop.
ENDPOINTS_PER_PAGE = 50
LOG_LINES = 15
EVENTS_SHOWN = 20
CHART_MINUTES = 60
# Long enough to show an endpoint idling to zero and waking again at its default idle time.
TIMELINE = timedelta(hours=6)
# A new endpoint's timeline still spans this much, so its axis reads in minutes.
SHORTEST_TIMELINE = timedelta(minutes=15)
SNIPPET_MAX_TOKENS = 64


@login_required
def home(request: HttpRequest) -> HttpResponse:
    organization = current_organization(request)
    if organization is None:
        return render(request, "front/no_organization.html")
    return redirect("endpoints", org_slug=organization.slug)


@login_required
def new_endpoint_shortcut(request: HttpRequest) -> HttpResponse:
    """`/endpoints/new/`: the wizard of the organisation opened last (what `make run` prints)."""
    organization = current_organization(request)
    if organization is None:
        return render(request, "front/no_organization.html")
    return redirect("endpoint-new", org_slug=organization.slug)


@login_required
def endpoint_list(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = membership(request, org_slug)
    page = Paginator(selectors.endpoints_of(organization=member.organization).order_by("name"),
                     ENDPOINTS_PER_PAGE).get_page(request.GET.get("page"))
    ids = [endpoint.id for endpoint in page]
    totals = last_hour_totals(endpoint_ids=ids)
    day_costs = window_costs(endpoint_ids=ids, hours=24)
    month = month_to_date_by_endpoint(organization=member.organization)
    rows = [{"endpoint": endpoint, "usage": totals.get(endpoint.id),
             "ready": sum(replica.state == State.READY for replica in endpoint.replicas.all()),
             "month_cents": month.get(endpoint.id, 0), "day": day_costs[endpoint.id],
             "wake_seconds": _wake_seconds(endpoint)}
            for endpoint in page]
    return render(request, "front/endpoints.html", {
        "member": member, "organization": member.organization, "page": page, "rows": rows,
        "section": "endpoints"})


@login_required
def endpoint_detail(request: HttpRequest, org_slug: str, name: str,
                    scaling_form: ScalingForm | None = None,
                    policy_form: PolicyForm | None = None, status: int = 200) -> HttpResponse:
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    gateway = settings.KVRUN_GATEWAY_URL
    device = accelerator_of(endpoint.gpu_type).memory_bytes
    sized = "weight_bytes_per_gpu" in endpoint.sizing  # absent only on hand-made rows
    costs = {label: window_costs(endpoint_ids=[endpoint.id], hours=hours)[endpoint.id]
             for label, hours in (("hour", 1), ("day", 24))}
    month = month_to_date_by_endpoint(organization=member.organization).get(endpoint.id, 0)
    return render(request, "front/endpoint.html", {
        "costs": costs, "month_cents": month,
        "advice": Advice.objects.filter(endpoint=endpoint, resolved_at=None),
        "policy_form": policy_form or PolicyForm.of(endpoint),
        "scaling_form": scaling_form or ScalingForm.of(endpoint),
        "memory": memory_bar(endpoint.sizing, device) if sized else None, "device_bytes": device,
        "member": member, "organization": member.organization, "endpoint": endpoint,
        "section": "endpoints", "status": _status(endpoint),
        "gateway": gateway, "snippets": _snippets(endpoint.name, gateway),
    }, status=status)


@login_required
def endpoint_status(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    """The live part of the endpoint page, polled every 2 s."""
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    return render(request, "front/_status.html", {
        "organization": member.organization, "endpoint": endpoint, "status": _status(endpoint)})


@login_required
def endpoint_usage(request: HttpRequest, org_slug: str, name: str) -> JsonResponse:
    """The last hour from the usage records, a point per minute (idle minutes are zeros,
    and have no TTFT), for the charts."""
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    now = timezone.now()
    rows = {row["minute"]: row for row in usage_by_minute(endpoint_id=endpoint.id, now=now)}
    current = now.replace(second=0, microsecond=0)
    minutes = [current - timedelta(minutes=back) for back in range(CHART_MINUTES - 1, -1, -1)]
    idle = {"requests": 0, "failed": 0, "refused": 0, "prompt_tokens": 0, "completion_tokens": 0,
            "ttft_p50_ms": None, "ttft_p95_ms": None}
    series = [rows.get(minute, idle) for minute in minutes]
    return JsonResponse({
        "minutes": [int(minute.timestamp()) for minute in minutes],
        "requests_per_second": [round(row["requests"] / 60, 4) for row in series],
        "tokens_per_second": [round(row["completion_tokens"] / 60, 3) for row in series],
        "failed": [row["failed"] for row in series],
        "refused": [row["refused"] for row in series],
        "ttft_p50_ms": [row["ttft_p50_ms"] for row in series],
        "ttft_p95_ms": [row["ttft_p95_ms"] for row in series],
        "requests": sum(row["requests"] for row in rows.values()),
        "prompt_tokens": sum(row["prompt_tokens"] for row in rows.values()),
        "completion_tokens": sum(row["completion_tokens"] for row in rows.values()),
    })


@login_required
def endpoint_replicas(request: HttpRequest, org_slug: str, name: str) -> JsonResponse:
    """The replica timeline: how many replicas were ready, starting (scheduled or loading)
    and stopping (draining) over the last six hours, a point at each change."""
    endpoint = endpoint_of(membership(request, org_slug), name)
    now = timezone.now()
    timeline = selectors.replica_timeline(
        endpoint_id=endpoint.id, until=now,
        since=max(now - TIMELINE, min(endpoint.created_at, now - SHORTEST_TIMELINE)))
    timeline.append((now, timeline[-1][1]))  # the last counts hold until now
    return JsonResponse({
        "times": [round(moment.timestamp(), 3) for moment, _ in timeline],
        "ready": [phases[BilledPhase.READY] for _, phases in timeline],
        "starting": [phases[BilledPhase.STARTING] + phases[BilledPhase.LOADING]
                     for _, phases in timeline],
        "stopping": [phases[BilledPhase.STOPPING] for _, phases in timeline],
    })


def _wake_seconds(endpoint: Endpoint) -> float | None:
    """For an endpoint scaled to zero: how long its next request will wait, from this model's
    recent starts on this kind of node; None otherwise or with no start to go by."""
    if endpoint.state != State.IDLE:
        return None
    return selectors.median_start_seconds(model_id=endpoint.model_id,
                                          gpu_type_id=endpoint.gpu_type_id)


def _status(endpoint: Endpoint) -> dict[str, object]:
    """State, progress, ETA, replicas, events and the leading engine's last log lines."""
    replicas = list(endpoint.replicas.all())
    progress = selectors.progress_of(endpoint=endpoint, replicas=replicas)
    starting = [replica for replica in replicas
                if replica.state in COMING_UP]
    leader = max(starting, key=lambda replica: replica.progress_percent, default=None)
    status: dict[str, object] = {
        "progress": progress, "replicas": [r for r in replicas if r.state != State.STOPPED][:20],
        "ready": sum(replica.state == State.READY for replica in replicas),
        "events": list(endpoint.events.order_by("-at", "-id")[:EVENTS_SHOWN]),
        "settled": endpoint.state in ENDPOINT_AT_REST,
        "kv_cache_tokens": next((replica.kv_cache_tokens for replica in replicas
                                 if replica.kv_cache_tokens), None),
        "wake_seconds": _wake_seconds(endpoint),
    }
    if status["kv_cache_tokens"]:
        status["kv_cache_requests"] = status["kv_cache_tokens"] // endpoint.context_length
    logged = leader or next((replica for replica in replicas if replica.log_tail), None)
    if logged is not None:
        status["log_lines"] = "\n".join(logged.log_tail.splitlines()[-LOG_LINES:])
    if leader is not None:
        elapsed = (timezone.now() - leader.created_at).total_seconds()
        median = (selectors.median_start_seconds(model_id=endpoint.model_id,
                                                 gpu_type_id=endpoint.gpu_type_id))
        status.update(elapsed_seconds=round(elapsed), median_seconds=median)
        if median:
            status["eta_seconds"] = max(0, round(median - elapsed))
            # Between stage changes the bar moves with time, capped below the next stage.
            by_time = min(95, round(100 * elapsed / median))
            status["progress"] = {**progress, "percent": max(progress["percent"], by_time)}
    return status


def _snippets(name: str, gateway: str) -> dict[str, str]:
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": SNIPPET_MAX_TOKENS})
    return {
        "curl": (f"curl {gateway}/v1/chat/completions \\\n"
                 f"  -H \"Authorization: Bearer $KVRUN_API_KEY\" \\\n"
                 f"  -H 'Content-Type: application/json' \\\n"
                 f"  -d '{body}'"),
        "python": ("import os\n\nfrom openai import OpenAI\n\n"
                   f"client = OpenAI(base_url=\"{gateway}/v1\", "
                   "api_key=os.environ[\"KVRUN_API_KEY\"])\n"
                   f"answer = client.chat.completions.create(\n    model=\"{name}\",\n"
                   "    messages=[{\"role\": \"user\", \"content\": \"Hello!\"}],\n"
                   f"    max_tokens={SNIPPET_MAX_TOKENS},\n)\n"
                   "print(answer.choices[0].message.content)\n"),
    }


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


@login_required
@require_POST
def scale_endpoint(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def scale(member: Member, endpoint: Endpoint) -> str:
        form = ScaleForm(request.POST)
        if not form.is_valid():
            raise ValidationError(form.errors["replicas"])
        services.do_scale_endpoint(endpoint=endpoint, actor_role=member.role,
                                   replicas=form.cleaned_data["replicas"])
        return f"Scaling {name} to {form.cleaned_data['replicas']} replica(s)."
    return change_endpoint(request, org_slug, name, scale)


SettingsForm = ScalingForm | PolicyForm


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
    forms = {"scaling_form": form} if isinstance(form, ScalingForm) else {"policy_form": form}
    return endpoint_detail(request, org_slug, name, status=400, **forms)


@login_required
@require_POST
def change_scaling(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def change(member: Member, endpoint: Endpoint, values: dict[str, Any]) -> str:
        changed = services.do_change_endpoint_scaling(endpoint=endpoint, actor_role=member.role,
                                                      changes=values)
        return (f"Scaling changed: {changed.min_replicas} to {changed.max_replicas} replicas, "
                f"{changed.desired_replicas} now.")
    return change_settings(request, org_slug, name, ScalingForm(request.POST), change)


@login_required
@require_POST
def stop_endpoint(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def stop(member: Member, endpoint: Endpoint) -> str:
        services.do_stop_endpoint(endpoint=endpoint, actor_role=member.role)
        return f"Stopping {name}; its GPU time ends when its engines exit."
    return change_endpoint(request, org_slug, name, stop)


@login_required
@require_POST
def start_endpoint(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def start(member: Member, endpoint: Endpoint) -> str:
        services.do_start_endpoint(endpoint=endpoint, actor_role=member.role)
        return f"Starting {name}."
    return change_endpoint(request, org_slug, name, start)


@login_required
@require_POST
def delete_endpoint(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    try:
        services.do_delete_endpoint(endpoint=endpoint, actor_role=member.role)
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("endpoint", org_slug=org_slug, name=name)
    messages.success(request, f"Deleted {name}; its engines are stopping.")
    return redirect("endpoints", org_slug=org_slug)
