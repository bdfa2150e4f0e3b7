"""What a node may read through the node channel: its own replicas, what starting one needs,
and, while one needs them, its model's or adapters' hub tokens and uploaded files. Each
takes the calling node and finds nothing of another node's."""

import hashlib
import json
from typing import Any
from uuid import UUID

from django.conf import settings

from endpoints.dispatch import pulls_for
from endpoints.models import Adapter, AdapterSource, ModelSpec, Node, Replica, State
from endpoints.selectors import hub_token_of
from endpoints.states import HOLDING_DEVICES
from engine.sizing import CPU, GIB
from fleet.models import NodeCredential
from kvrun.common.digests import engine_api_key


class NotNow(Exception):
    """The replica is not in a state in which its agent may have, or do, that."""


# While a replica is in one of these, its agent may fetch its model's files (and the token).
FETCHING_MODEL = [State.DOWNLOADING]
# While in one of these, its engine is being started (and a certificate signed for it).
STARTING_ENGINE = [State.STARTING, State.DOWNLOADING, State.LOADING]
# While in one of these, its endpoint's adapters (an adapter is added while it serves).
SERVING_ADAPTERS = [State.LOADING, State.READY]


def node_replica(*, node: Node, replica_id: UUID) -> Replica | None:
    """The replica if it is on `node`; None for an id of another node or none at all."""
    return (Replica.objects.select_related("endpoint__model", "endpoint__gpu_type")
            .filter(id=replica_id, node=node).first())


def node_replicas(*, node: Node) -> list[dict[str, Any]]:
    """The node's replicas that have, or may have, an engine there, each with the pinned
    hub snapshots (repository, commit) of its model and adapters: its node's model cache
    keeps them."""
    replicas = list(Replica.objects.filter(node=node, state__in=HOLDING_DEVICES)
                    .order_by("id").values_list("id", "state", "port", "endpoint_id",
                                                "endpoint__organization_id",
                                                "endpoint__model__hf_repo",
                                                "endpoint__model__hf_commit"))
    pinned: dict[UUID, list[list[str]]] = {}
    served: dict[UUID, list[list[str]]] = {}
    for adapter in Adapter.objects.filter(
            endpoint_id__in={row[3] for row in replicas}).order_by("name"):
        served.setdefault(adapter.endpoint_id, []).append([adapter.name, adapter.folder])
        if adapter.source == AdapterSource.HUB:
            pinned.setdefault(adapter.endpoint_id, []).append(
                [adapter.hf_repo, adapter.hf_commit])
    return [{"id": str(replica_id), "state": state, "port": port,
             "endpoint": str(endpoint_id), "organization": str(organization_id),
             "pinned": ([[repo, commit]] if commit else []) + pinned.get(endpoint_id, []),
             "adapters": served.get(endpoint_id, [])}
            for replica_id, state, port, endpoint_id, organization_id, repo, commit in replicas]


def node_work(*, node: Node) -> dict[str, Any]:
    """The node's work as its rows state it now: its replicas (nodes.agent starts those
    starting, stops those stopping, and serves each ready one's adapters) and the pulls that
    wait for it; `version` changes whenever any of it does."""
    work = {"replicas": node_replicas(node=node), "pulls": pulls_for(node_id=node.id)}
    return {"version": hashlib.sha256(json.dumps(work, sort_keys=True).encode()).hexdigest(),
            **work}


def rotation_asked(*, node: Node) -> bool:
    """Whether an operator asked the node to rotate its credential, and it has not yet."""
    return NodeCredential.objects.filter(node=node, revoked_at=None,
                                         rotation_asked_at__isnull=False).exists()


def node_timings() -> dict[str, float]:
    """How often agents beat and read their engines, and how long they wait on engines: the
    control plane's settings, told to each agent as it registers, so that both agree."""
    return {"heartbeat_seconds": settings.KVRUN_NODE_HEARTBEAT_SECONDS,
            "scrape_seconds": settings.KVRUN_ENGINE_SCRAPE_SECONDS,
            "start_timeout_seconds": settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS,
            "stop_grace_seconds": settings.KVRUN_ENGINE_STOP_GRACE_SECONDS,
            "drain_seconds": settings.KVRUN_ENGINE_DRAIN_SECONDS,
            "route_cache_seconds": settings.KVRUN_GATEWAY_ROUTE_CACHE_SECONDS}


def model_spec(*, model: ModelSpec) -> dict[str, Any]:
    """Where an engine's weights come from."""
    return {"id": model.id, "slug": model.slug, "hf_repo": model.hf_repo,
            "hf_commit": model.hf_commit, "files": model.files,
            "trust_remote_code": model.trust_remote_code,
            "task": model.task, "architecture": model.architecture,
            "tool_call_parser": model.tool_call_parser,
            "reasoning_parser": model.reasoning_parser,
            # An organisation's model is never looked for in an operator's folders.
            "catalog": model.organization_id is None}


def replica_spec(*, replica: Replica) -> dict[str, Any]:
    """Everything the replica's agent needs to start its engine, its key included (derived
    here: the pepper never leaves the control plane)."""
    endpoint = replica.endpoint
    assert replica.node_id is not None  # node_replica found it on the calling node
    return {
        "id": str(replica.id),
        "state": replica.state,
        "port": replica.port,
        "policy_version": endpoint.policy_version,
        "device_indices": list(replica.device_indices),
        "engine_key": engine_api_key(replica_id=replica.id, node_id=replica.node_id),
        "endpoint": {
            "id": str(endpoint.id), "name": endpoint.name,
            "organization": str(endpoint.organization_id),
            "device": CPU if endpoint.gpu_type.slug == CPU else "gpu",
            "gpu_count": endpoint.gpu_count, "context_length": endpoint.context_length,
            "concurrency": endpoint.concurrency,
            "kv_cache_dtype": endpoint.kv_cache_dtype, "prefix_caching": endpoint.prefix_caching,
            "host_tier_gib": endpoint.host_tier_gib, "disk_tier_gib": endpoint.disk_tier_gib,
            # Endpoints sized before the exact budget had a whole GiB.
            "cpu_kv_cache_bytes": endpoint.sizing.get("cpu_kv_cache_bytes") or GIB,
            "lora_adapters": endpoint.lora_adapters, "lora_max_rank": endpoint.lora_max_rank,
            "lora_host_adapters": endpoint.lora_host_adapters,
        },
        "model": model_spec(model=endpoint.model),
    }


def replica_adapters(*, replica: Replica) -> list[dict[str, Any]]:
    """The adapters the replica's engine must serve, and where each one's files come from."""
    return [{"id": adapter.id, "name": adapter.name, "folder": adapter.folder,
             "source": adapter.source, "hf_repo": adapter.hf_repo,
             "hf_commit": adapter.hf_commit, "files": adapter.files}
            for adapter in Adapter.objects.filter(endpoint_id=replica.endpoint_id)
            .order_by("name")]


def hub_token_for(*, replica: Replica, adapter_id: int | None = None) -> str | None:
    """The hub token that fetching the replica's model (or, given `adapter_id`, that adapter
    of its endpoint) needs, opened for this request: only while the replica fetches it.
    Raises NotNow when the replica may not have it now."""
    if adapter_id is None:
        if replica.state not in FETCHING_MODEL:
            raise NotNow("The replica is not downloading its weights.")
        return hub_token_of(replica.endpoint.model)
    adapter = Adapter.objects.filter(id=adapter_id, endpoint_id=replica.endpoint_id,
                                     source=AdapterSource.HUB).first()
    if adapter is None or replica.state not in SERVING_ADAPTERS:
        raise NotNow("The replica does not serve that adapter now.")
    return hub_token_of(adapter)


def uploaded_adapter_file(*, replica: Replica, adapter_id: int, path: str) -> bytes | None:
    """A file of an uploaded adapter of the replica's endpoint, while the replica serves its
    adapters; None otherwise."""
    if replica.state not in SERVING_ADAPTERS or "\x00" in path:  # no column holds a NUL
        return None
    upload = (Adapter.objects.filter(id=adapter_id, endpoint_id=replica.endpoint_id,
                                     source=AdapterSource.UPLOAD).first())
    if upload is None:
        return None
    found = upload.uploads.filter(path=path).first()
    return bytes(found.content) if found is not None else None
