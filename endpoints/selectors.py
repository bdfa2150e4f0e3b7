from django.db.models import Prefetch, QuerySet

from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica


def model_catalog() -> QuerySet[ModelSpec]:
    return ModelSpec.objects.all()


def gpu_catalog() -> QuerySet[GPUType]:
    return GPUType.objects.all()


def gpu_type_for_device(*, device_name: str, memory_bytes: int) -> GPUType | None:
    """The catalog type whose match string is in the driver's name, closest in memory."""
    candidates = [
        gpu for gpu in GPUType.objects.exclude(device_match="")
        if gpu.device_match.lower() in device_name.lower()
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda gpu: abs(gpu.memory_bytes - memory_bytes))


def nodes() -> QuerySet[Node]:
    return Node.objects.select_related("gpu_type")


def endpoints_of(*, organization: object) -> QuerySet[Endpoint]:
    """The organisation's endpoints that are not deleted, with what their responses show."""
    return (Endpoint.objects.filter(organization=organization, deleted_at=None)
            .select_related("model", "gpu_type")
            .prefetch_related(Prefetch("replicas", queryset=Replica.objects.select_related("node")
                                       .order_by("-created_at"))))
