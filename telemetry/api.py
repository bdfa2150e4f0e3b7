"""The engine metrics REST API: an endpoint's series, for every member of its organisation."""

from datetime import timedelta

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.scoping import OrganizationScoped
from endpoints.selectors import endpoints_of
from telemetry import selectors
from telemetry.models import Advice
from telemetry.services import do_apply_advice

WINDOWS = {"15m": timedelta(minutes=15), "1h": timedelta(hours=1), "6h": timedelta(hours=6),
           "24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}


class SeriesQuery(serializers.Serializer):
    window = serializers.ChoiceField(choices=list(WINDOWS), default="1h")
    replica = serializers.UUIDField(required=False)


class EndpointMetrics(OrganizationScoped, GenericAPIView):
    """KV cache usage, prefix-cache hit rate (hits over lookups in each step), preemptions,
    running and waiting requests, TTFT and inter-token latency percentiles, tokens and
    requests per second, and a KV connector's hit rate where there is one: over the
    endpoint's replicas, or one (`replica`), in about 120 steps over `window`."""

    filter_backends = ()

    @extend_schema(parameters=[SeriesQuery], responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request, name: str, **kwargs: str) -> Response:
        query = SeriesQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        endpoint = get_object_or_404(endpoints_of(organization=self.organization), name=name)
        until = timezone.now()
        since = until - WINDOWS[query.validated_data["window"]]
        step, points = selectors.series(endpoint_id=endpoint.id, since=since, until=until,
                                        replica_id=query.validated_data.get("replica"))
        return Response({"endpoint": endpoint.name, "window": query.validated_data["window"],
                         "step_seconds": step, "points": points})


class AdviceSerializer(serializers.ModelSerializer):
    class Meta:
        model = Advice
        fields = ["id", "kind", "message", "figures", "change", "opened_at", "last_seen_at"]


class EndpointAdvice(OrganizationScoped, GenericAPIView):
    """The endpoint's open advice, each with the figures behind it and, where a policy
    change applies it, that change."""

    filter_backends = ()
    pagination_class = None
    serializer_class = AdviceSerializer

    def get(self, request: Request, name: str, **kwargs: str) -> Response:
        endpoint = get_object_or_404(endpoints_of(organization=self.organization), name=name)
        advice = Advice.objects.filter(endpoint=endpoint, resolved_at=None)
        return Response(AdviceSerializer(advice, many=True).data)


class ApplyAdvice(OrganizationScoped, APIView):
    """Apply an open advice's policy change (owners and admins); the answer's `rollout` says
    whether and how replicas restart."""

    @extend_schema(request=None, responses={200: OpenApiTypes.OBJECT})
    def post(self, request: Request, name: str, advice_id: int, **kwargs: str) -> Response:
        endpoint = get_object_or_404(endpoints_of(organization=self.organization), name=name)
        advice = get_object_or_404(Advice.objects.select_related("endpoint__model",
                                                                 "endpoint__gpu_type"),
                                   id=advice_id, endpoint=endpoint)
        rollout = do_apply_advice(advice=advice, actor_role=self.actor_role)
        return Response({"rollout": rollout})
