"""Endpoints: the list, one endpoint's page with its live status and charts, and the
actions on it (scale, stop, start, delete)."""

from datetime import datetime, timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing.selectors import (
    last_hour_totals,
    month_to_date_by_endpoint,
    tokens_by_minute_and_adapter,
    usage_by_minute,
    window_costs,
)
from endpoints import selectors, services
from endpoints.models import Endpoint
from endpoints.states import BilledPhase, State
from front import presenters
from front.forms import ScaleForm, ScalingForm
from front.scoping import Member, current_organization, endpoint_of, membership
from front.views.shared import change_endpoint, change_settings, endpoint_page

# Fewer rows than this per page keeps the list one screen on a laptop.
ENDPOINTS_PER_PAGE = 50
CHART_MINUTES = 60
# Long enough to show an endpoint idling to zero and waking again at its default idle time.
TIMELINE = timedelta(hours=6)
# A new endpoint's timeline still spans this much, so its axis reads in minutes.
SHORTEST_TIMELINE = timedelta(minutes=15)


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
             "wake_seconds": presenters.wake_seconds(endpoint)}
            for endpoint in page]
    return render(request, "front/endpoints.html", {
        "member": member, "organization": member.organization, "page": page, "rows": rows,
        "section": "endpoints"})


@login_required
def endpoint_detail(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    member = membership(request, org_slug)
    return endpoint_page(request, member, endpoint_of(member, name))


@login_required
def endpoint_status(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    """The live part of the endpoint page, polled every 2 s."""
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    return render(request, "front/_status.html", {
        "organization": member.organization, "endpoint": endpoint,
        "status": presenters.endpoint_status(endpoint)})


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
    # Generated tokens per minute of the model and of each adapter, keyed "model:<name>".
    by_model: dict[str, dict[datetime, int]] = {
        f"model:{model}": {} for model in presenters.model_names(endpoint)}
    for row in tokens_by_minute_and_adapter(endpoint_id=endpoint.id, now=now):
        model = f"model:{endpoint.name}" + (f":{row['adapter']}" if row["adapter"] else "")
        by_model.setdefault(model, {})[row["minute"]] = row["completion_tokens"]
    return JsonResponse({
        **{model: [round(tokens.get(minute, 0) / 60, 3) for minute in minutes]
           for model, tokens in by_model.items()},
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
