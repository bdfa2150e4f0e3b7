"""An endpoint's KV cache on its page: the engines' live series for the charts, the KV
policy form, and the advice with its one-click change."""

from datetime import timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.views.decorators.http import require_POST

from endpoints import services
from endpoints.models import Endpoint
from front.forms import PolicyForm
from front.scoping import Member, endpoint_of, membership
from front.views.shared import change_endpoint, change_settings
from telemetry import selectors
from telemetry.models import Advice
from telemetry.services import do_apply_advice

CHART_WINDOW = timedelta(hours=1)
CHART_STEPS = 60


def _percent(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 1)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 1)


@login_required
def endpoint_kv_series(request: HttpRequest, org_slug: str, name: str) -> JsonResponse:
    """The last hour of the engines' metrics, a point per minute with samples in it."""
    endpoint = endpoint_of(membership(request, org_slug), name)
    now = timezone.now()
    _, points = selectors.series(endpoint_id=endpoint.id, since=now - CHART_WINDOW, until=now,
                                 steps=CHART_STEPS)
    return JsonResponse({
        # The window, for the charts' axis: the points are only the minutes with samples.
        "since": int((now - CHART_WINDOW).timestamp()), "until": int(now.timestamp()),
        "times": [int(point["at"].timestamp()) for point in points],
        "kv_cache_usage_pct": [_percent(point["kv_cache_usage"]) for point in points],
        "prefix_hit_rate_pct": [_percent(point["prefix_hit_rate"]) for point in points],
        "tier_hit_rate_pct": [_percent(point["external_hit_rate"]) for point in points],
        "preemptions": [point["preemptions"] for point in points],
        "running": [point["running"] for point in points],
        "waiting": [point["waiting"] for point in points],
        "itl_p50_ms": [_ms(point["itl_p50_s"]) for point in points],
        "itl_p95_ms": [_ms(point["itl_p95_s"]) for point in points],
    })


@login_required
@require_POST
def change_policy(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def change(member: Member, endpoint: Endpoint, values: dict[str, Any]) -> str:
        return "KV policy changed. " + services.do_change_endpoint_policy(
            endpoint=endpoint, actor_role=member.role, changes=values)
    return change_settings(request, org_slug, name, PolicyForm(request.POST), change)


@login_required
@require_POST
def apply_advice(request: HttpRequest, org_slug: str, name: str, advice_id: int
                 ) -> HttpResponse:
    def apply(member: Member, endpoint: Endpoint) -> str:
        advice = get_object_or_404(Advice, id=advice_id, endpoint=endpoint)
        return "Advice applied. " + do_apply_advice(advice=advice, actor_role=member.role)
    return change_endpoint(request, org_slug, name, apply)
