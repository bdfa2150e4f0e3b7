from functools import cached_property
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import generics, mixins, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.models import Organization, User
from accounts.scoping import OrganizationScoped
from endpoints import selectors, services
from endpoints.models import Adapter, Endpoint, GPUType, ModelSpec, Region
from endpoints.planning import check_tiers, plan, sizing_preview
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.scheduling import Placement
from endpoints.selectors import OwnNode
from endpoints.serializers import (
    AdapterInput,
    AdapterSerializer,
    AdapterUploadInput,
    EndpointInput,
    EndpointSerializer,
    EventSerializer,
    GPUTypeSerializer,
    ModelFromHubInput,
    ModelSpecSerializer,
    OwnModelSerializer,
    OwnNodeSerializer,
    PolicyInput,
    RegionSerializer,
    ScaleInput,
    ScalingInput,
    SizingInput,
)
from kvrun.common.api import validated


class ModelCatalogViewSet(viewsets.ReadOnlyModelViewSet):
    """Open models kvrun can serve, with the numbers sizing uses."""

    serializer_class = ModelSpecSerializer
    lookup_field = "slug"
    lookup_value_regex = "[^/]+"
    filterset_fields = ["family", "attention_kind", "licence"]
    ordering_fields = ["parameters", "max_context", "name"]
    ordering = ["family", "parameters"]

    def get_queryset(self) -> QuerySet[ModelSpec]:
        return selectors.model_catalog()


class GPUCatalogViewSet(viewsets.ReadOnlyModelViewSet):
    """Accelerators kvrun can place engines on, with their list prices."""

    serializer_class = GPUTypeSerializer
    lookup_field = "slug"
    lookup_value_regex = "[^/]+"
    filterset_fields = ["vendor"]
    ordering_fields = ["hourly_price_usd", "memory_bytes", "bandwidth_gb_s"]
    ordering = ["hourly_price_usd"]

    def get_queryset(self) -> QuerySet[GPUType]:
        return selectors.gpu_catalog()


class RegionViewSet(viewsets.ReadOnlyModelViewSet):
    """Where kvrun has nodes: an endpoint may require a region, and then runs there alone."""

    serializer_class = RegionSerializer
    lookup_field = "slug"

    def get_queryset(self) -> QuerySet[Region]:
        return selectors.regions()


@extend_schema(request=SizingInput, responses={200: OpenApiTypes.OBJECT})
@api_view(["POST"])
def size(request: Request) -> Response:
    """The capacity planner: what an endpoint (model, context, concurrency, GPU and count, KV
    policy) of a public catalog model would need, hold and cost, without creating it; a
    policy that does not fit is a 400 saying what would."""
    return Response(_sized(validated(SizingInput, request)))


class OrganizationSizing(OrganizationScoped, APIView):
    @extend_schema(request=SizingInput, responses={200: OpenApiTypes.OBJECT})
    def post(self, request: Request, **kwargs: str) -> Response:
        """The capacity planner for the organisation's endpoints: the public catalog's
        models and its own."""
        return Response(_sized(validated(SizingInput, request,
                                         context={"organization": self.organization}),
                               organization=self.organization))


def _sized(data: dict[str, Any], *, organization: Organization | None = None
           ) -> dict[str, Any]:
    placement = Placement(region=data.get("region"), own_nodes_only=data["own_nodes_only"],
                  organization_id=organization.id if organization is not None else None)
    decided = plan(model=data["model"], context_length=data["context_length"],
                   concurrency=data["concurrency"], kv_cache_dtype=data["kv_cache_dtype"],
                   gpu_type=data.get("gpu_type"), gpu_count=data.get("gpu_count"),
                   host_tier_gib=data["host_tier_gib"], disk_tier_gib=data["disk_tier_gib"],
                   lora_adapters=data["lora_adapters"],
                   lora_max_rank=data["lora_max_rank"], placement=placement)
    check_tiers(host_tier_gib=data["host_tier_gib"], disk_tier_gib=data["disk_tier_gib"],
                gpu_type=decided.gpu_type, gpu_count=decided.gpu_count, placement=placement)
    return decided.summary


class OrganizationNodes(OrganizationScoped, generics.ListAPIView):
    """The organisation's own nodes, by name, and their health: state, hardware, free GPUs
    and the replicas on each (docs/operations.md, "Your organisation's own nodes")."""

    serializer_class = OwnNodeSerializer
    filter_backends: list = []  # a few nodes, by name: nothing to filter or order them by

    def get_queryset(self) -> list[OwnNode]:  # type: ignore[override]
        if getattr(self, "swagger_fake_view", False):
            return []
        return selectors.own_nodes_of(organization=self.organization)


class EndpointViewSet(OrganizationScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                      viewsets.GenericViewSet):
    serializer_class = EndpointSerializer
    lookup_field = "name"
    filterset_fields = ["state"]
    ordering_fields = ["created_at", "name", "state"]
    ordering = ["name"]

    def get_queryset(self) -> QuerySet[Endpoint]:
        if getattr(self, "swagger_fake_view", False):
            return Endpoint.objects.none()
        return selectors.endpoints_of(organization=self.organization)

    @extend_schema(request=EndpointInput, responses={201: EndpointSerializer})
    def create(self, request: Request, **kwargs: str) -> Response:
        data = validated(EndpointInput, request, context={"organization": self.organization})
        endpoint = services.do_create_endpoint(
            organization=self.organization, actor_role=self.actor_role,
            created_by=request.user if isinstance(request.user, User) else None,
            name=data["name"], model=data["model"], gpu_type=data.get("gpu_type"),
            gpu_count=data.get("gpu_count"), region=data.get("region"),
            own_nodes_only=data["own_nodes_only"],
            policy=EndpointPolicy.from_values(data),
            scaling=EndpointScaling.from_values(data))
        return Response(self.get_serializer(self._fresh(endpoint)).data,
                        status=status.HTTP_201_CREATED)

    @extend_schema(request=ScaleInput, responses=EndpointSerializer)
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, **kwargs: str) -> Response:
        data = validated(ScaleInput, request)
        endpoint = services.do_scale_endpoint(endpoint=self.get_object(),
                                              actor_role=self.actor_role, **data)
        return Response(self.get_serializer(self._fresh(endpoint)).data)

    @extend_schema(request=PolicyInput, responses=EndpointSerializer)
    @action(detail=True, methods=["patch"])
    def policy(self, request: Request, **kwargs: str) -> Response:
        """Change the KV policy; the answer's `rollout` says whether and how replicas
        restart."""
        data = validated(PolicyInput, request)
        endpoint = self.get_object()
        rollout = services.do_change_endpoint_policy(endpoint=endpoint,
                                                     actor_role=self.actor_role, changes=data)
        return Response({**self.get_serializer(self._fresh(endpoint)).data, "rollout": rollout})

    @extend_schema(request=ScalingInput, responses=EndpointSerializer)
    @action(detail=True, methods=["patch"])
    def scaling(self, request: Request, **kwargs: str) -> Response:
        """Change how the endpoint scales: its replica range, scale to zero's idle time, the
        autoscaler's metric, target and windows."""
        data = validated(ScalingInput, request)
        endpoint = services.do_change_endpoint_scaling(
            endpoint=self.get_object(), actor_role=self.actor_role, changes=data)
        return Response(self.get_serializer(self._fresh(endpoint)).data)

    @extend_schema(request=None, responses=EndpointSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, **kwargs: str) -> Response:
        endpoint = services.do_stop_endpoint(endpoint=self.get_object(), actor_role=self.actor_role)
        return Response(self.get_serializer(self._fresh(endpoint)).data)

    @extend_schema(request=None, responses=EndpointSerializer)
    @action(detail=True, methods=["post"])
    def start(self, request: Request, **kwargs: str) -> Response:
        endpoint = services.do_start_endpoint(endpoint=self.get_object(),
                                              actor_role=self.actor_role)
        return Response(self.get_serializer(self._fresh(endpoint)).data)

    def destroy(self, request: Request, **kwargs: str) -> Response:
        services.do_delete_endpoint(endpoint=self.get_object(), actor_role=self.actor_role)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses=EventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request: Request, **kwargs: str) -> Response:
        events = self.get_object().events.order_by("-at", "-id")
        page = self.paginate_queryset(events)
        return self.get_paginated_response(EventSerializer(page, many=True).data)

    def _fresh(self, endpoint: Endpoint) -> Endpoint:
        return self.get_queryset().get(id=endpoint.id)


class AdapterViewSet(OrganizationScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     viewsets.GenericViewSet):
    """The LoRA adapters an endpoint serves beside its model."""

    serializer_class = AdapterSerializer
    lookup_field = "name"

    @cached_property
    def endpoint(self) -> Endpoint:
        return get_object_or_404(selectors.endpoints_of(organization=self.organization),
                                 name=self.kwargs["endpoint_name"])

    def get_queryset(self) -> QuerySet[Adapter]:
        if getattr(self, "swagger_fake_view", False):
            return Adapter.objects.none()
        return selectors.adapters_of(endpoint=self.endpoint)

    @extend_schema(request=AdapterInput, responses={201: AdapterSerializer})
    def create(self, request: Request, **kwargs: str) -> Response:
        """Add an adapter by its hub id, pinned to the commit its revision resolves to now.
        Running replicas load it without a restart; one that does not fit the endpoint (its
        base model, rank, target modules) is a 400 saying why."""
        data = validated(AdapterInput, request)
        adapter = services.do_add_adapter_from_hub(
            endpoint=self.endpoint, actor_role=self.actor_role, added_by=self._user,
            name=data["name"], repo_id=data["hf_repo"], revision=data["hf_revision"],
            token=data["hf_token"])
        return self._created(adapter)

    @extend_schema(request={"multipart/form-data": AdapterUploadInput},
                   responses={201: AdapterSerializer})
    def upload(self, request: Request, **kwargs: str) -> Response:
        """Add an adapter from its two files (at most KVRUN_ADAPTER_UPLOAD_MIB together),
        judged as one from the hub."""
        data = validated(AdapterUploadInput, request)
        adapter = services.do_add_adapter_from_upload(
            endpoint=self.endpoint, actor_role=self.actor_role, added_by=self._user,
            name=data["name"], config_json=_read_upload(data["config"]),
            weights=_read_upload(data["weights"]))
        return self._created(adapter)

    @property
    def _user(self) -> User | None:
        return self.request.user if isinstance(self.request.user, User) else None

    def _created(self, adapter: Adapter) -> Response:
        return Response(self.get_serializer(self.get_queryset().get(id=adapter.id)).data,
                        status=status.HTTP_201_CREATED)

    def destroy(self, request: Request, **kwargs: str) -> Response:
        services.do_remove_adapter(adapter=self.get_object(), actor_role=self.actor_role)
        return Response(status=status.HTTP_204_NO_CONTENT)


def _read_upload(upload: UploadedFile) -> bytes:
    """An uploaded file's bytes, refused unread when it is over the upload limit."""
    limit = settings.KVRUN_ADAPTER_UPLOAD_MIB * 1024 * 1024
    if (upload.size or 0) > limit:
        raise ValidationError({upload.field_name or "weights": [
            f"{upload.name} takes {(upload.size or 0) / 2**20:.1f} MiB, more than uploads may "
            f"({settings.KVRUN_ADAPTER_UPLOAD_MIB} MiB): publish the adapter on the hub and "
            "add it by its id instead."]})
    return upload.read()


class OrganizationModelViewSet(OrganizationScoped, mixins.ListModelMixin,
                               mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Models the organisation added from a Hugging Face hub; only it sees them."""

    serializer_class = OwnModelSerializer
    lookup_field = "slug"
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[ModelSpec]:
        if getattr(self, "swagger_fake_view", False):
            return ModelSpec.objects.none()
        return selectors.models_of(organization=self.organization)

    @extend_schema(request=ModelFromHubInput, responses={201: OwnModelSerializer})
    def create(self, request: Request, **kwargs: str) -> Response:
        """Add a model by its hub id, pinned to the commit its revision resolves to now. The
        answer's `sizing` is what it would hold at its default context, before anything
        downloads; a repository kvrun cannot serve is a 400 saying why."""
        data = validated(ModelFromHubInput, request)
        model = services.do_add_model_from_hub(
            organization=self.organization, actor_role=self.actor_role,
            added_by=request.user if isinstance(request.user, User) else None,
            repo_id=data["hf_repo"], revision=data["hf_revision"], token=data["hf_token"],
            task=data.get("task"), tool_call_parser=data.get("tool_call_parser"),
            reasoning_parser=data.get("reasoning_parser"))
        return Response({**self.get_serializer(model).data, "sizing": sizing_preview(model)},
                        status=status.HTTP_201_CREATED)
