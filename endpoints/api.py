from django.db.models import QuerySet
from rest_framework import viewsets

from endpoints import selectors
from endpoints.models import GPUType, ModelSpec
from endpoints.serializers import GPUTypeSerializer, ModelSpecSerializer


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
