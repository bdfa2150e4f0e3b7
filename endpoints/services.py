"""Writes for catalogs and nodes."""

import json
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from endpoints.models import GPUType, ModelSpec, Node, NodeState
from endpoints.selectors import gpu_type_for_device
from engine.devices import HostResources

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"


def do_load_catalogs(*, directory: Path = CATALOG_DIR) -> tuple[int, int]:
    """Insert or update every model and GPU type from the catalog files, keyed by slug.

    Returns (models, gpu types) loaded. Rows not in the files are left alone, so an
    operator's additions survive a reload.
    """
    models = json.loads((directory / "models.json").read_text())
    gpus = json.loads((directory / "gpus.json").read_text())
    with transaction.atomic():
        _upsert(ModelSpec, models)
        _upsert(GPUType, gpus)
    return len(models), len(gpus)


def _upsert(model: type, rows: list[dict]) -> None:
    fields = [name for name in rows[0] if name != "slug"]
    model.objects.bulk_create(
        [model(**row) for row in rows], update_conflicts=True, unique_fields=["slug"],
        update_fields=fields,
    )


def do_register_node(*, name: str, resources: HostResources) -> Node:
    """Insert or refresh the node `name` with what its agent detected; it is online again."""
    if resources.devices:
        first = resources.devices[0]
        gpu_type = gpu_type_for_device(device_name=first.name, memory_bytes=first.memory_bytes)
    else:
        gpu_type = GPUType.objects.filter(slug="cpu").first()
    now = timezone.now()
    Node.objects.bulk_create(
        [
            Node(
                name=name, state=NodeState.ONLINE, gpu_type=gpu_type,
                devices=resources.devices_as_dicts(), cpu_count=resources.cpu_count,
                memory_bytes=resources.memory_bytes, registered_at=now, last_heartbeat_at=now,
            )
        ],
        update_conflicts=True,
        unique_fields=["name"],
        update_fields=["state", "gpu_type", "devices", "cpu_count", "memory_bytes",
                       "last_heartbeat_at"],
    )
    return Node.objects.get(name=name)


def do_record_node_heartbeat(*, name: str) -> bool:
    """Note that the node's agent is alive. Returns False when the node is not registered."""
    return Node.objects.filter(name=name).update(
        last_heartbeat_at=timezone.now(), state=NodeState.ONLINE
    ) == 1


def do_mark_lost_nodes() -> int:
    """Mark online nodes whose heartbeats stopped as lost. Returns how many."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVRUN_NODE_LOST_AFTER_SECONDS)
    return Node.objects.filter(state=NodeState.ONLINE, last_heartbeat_at__lt=cutoff).update(
        state=NodeState.LOST
    )
