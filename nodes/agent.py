"""The node agent's side of a replica: start its engine, watch it, stop it.

Runs inside `manage.py node_agent` (Celery threads on queue node.<name>). Engines are this
process's children, each in its own process group and told to die with the agent, so a
killed agent leaves no engine behind; the replicas it held are failed when it comes back.
"""

import logging
import threading
import time
from pathlib import Path
from subprocess import Popen
from uuid import UUID

from django.conf import settings
from django.utils import timezone

from endpoints.lifecycle import do_fail_replica, do_set_replica_progress, do_transition_replica
from endpoints.models import Node, Replica, State
from engine import demo_model, processes, supervisor
from engine.sizing import CPU, GPU
from kvrun.digests import engine_api_key

logger = logging.getLogger(__name__)

DEMO_SLUG = "kvrun-demo-tiny"
_engines: dict[str, Popen] = {}
_engines_lock = threading.Lock()


def log_path(replica_id: UUID | str) -> Path:
    return Path(settings.KVRUN_ENGINE_LOG_DIR) / f"{replica_id}.log"


def model_dir(slug: str, hf_repo: str) -> str:
    """Where the engine loads the model from: the built demo, a local copy, or the hub id."""
    if slug == DEMO_SLUG:
        return str(demo_model.build(Path(settings.KVRUN_MODEL_DIR) / DEMO_SLUG))
    local = Path(settings.KVRUN_MODEL_DIR) / slug
    return str(local) if local.exists() else hf_repo


def spec_for(replica: Replica, port: int) -> supervisor.EngineSpec:
    endpoint = replica.endpoint
    cpu = endpoint.gpu_type.slug == CPU
    return supervisor.EngineSpec(
        model_dir=model_dir(endpoint.model.slug, endpoint.model.hf_repo),
        served_model_name=endpoint.name,
        host=replica.node.address,
        port=port,
        max_model_len=endpoint.context_length,
        max_num_seqs=endpoint.concurrency,
        device=CPU if cpu else GPU,
        tensor_parallel=endpoint.gpu_count,
        kv_cache_dtype=endpoint.kv_cache_dtype,
        prefix_caching=endpoint.prefix_caching,
        cpu_kv_space_gib=endpoint.sizing.get("cpu_kv_space_gib") or 1,
        device_indices=tuple(replica.device_indices),
        api_key=engine_api_key(replica.id),
    )


def start_replica(replica_id: str) -> None:
    """Start the replica's engine and wait until it serves. A second delivery of the same start
    finds the replica no longer `starting` and does nothing: one engine per replica."""
    replica = (Replica.objects.select_related("endpoint__model", "endpoint__gpu_type", "node")
               .filter(id=replica_id).first())
    if replica is None:
        return
    port = processes.free_port(replica.node.address)
    if not do_transition_replica(replica_id=replica.id, from_states=[State.STARTING],
                                 to_state=State.LOADING, message="starting the engine",
                                 port=port):
        return
    log = log_path(replica.id)
    process = None
    try:
        do_set_replica_progress(replica_id=replica.id, state=State.LOADING,
                                stage="preparing the model", percent=45)
        spec = spec_for(replica, port)
        process = supervisor.start(spec, log)
        with _engines_lock:
            _engines[str(replica.id)] = process
        Replica.objects.filter(id=replica.id).update(pid=process.pid)
        do_set_replica_progress(replica_id=replica.id, state=State.LOADING,
                                stage="loading weights and allocating the KV cache", percent=50)
        supervisor.wait_ready(
            host=spec.host, port=port, served_model_name=spec.served_model_name, api_key=spec.api_key,
            alive=lambda: process.poll() is None,
            timeout=settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS,
            on_progress=lambda stage: do_set_replica_progress(
                replica_id=replica.id, state=State.LOADING, stage="engine healthy, loading API",
                percent=90),
        )
    except (supervisor.EngineFailed, OSError) as exc:
        if process is not None:
            _forget_and_stop(str(replica.id), process)
        _record_failure(replica.id, str(exc), log, from_states=[State.LOADING])
        return
    capacity = supervisor.read_kv_capacity(log.read_text(errors="replace"))
    do_transition_replica(
        replica_id=replica.id, from_states=[State.LOADING], to_state=State.READY,
        message=f"ready on port {port}" + (f", KV cache {capacity:,} tokens" if capacity else ""),
        kv_cache_tokens=capacity, ready_at=timezone.now(), restarts=0,
        log_tail=supervisor.tail(log),
    )


def stop_replica(replica_id: str) -> None:
    """Stop the replica's engine: SIGTERM, SIGKILL after the grace period; wait for the port."""
    replica = Replica.objects.select_related("node").filter(id=replica_id).first()
    if replica is None or replica.state != State.STOPPING:
        return
    with _engines_lock:
        process = _engines.pop(str(replica.id), None)
    pid = process.pid if process is not None else replica.pid
    if pid:
        processes.stop_group(pid, grace=settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
    if process is not None:
        process.wait(timeout=10)
    deadline = time.monotonic() + 10
    host = replica.node.address if replica.node else "127.0.0.1"
    while (replica.port and not processes.port_is_free(replica.port, host)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    do_transition_replica(replica_id=replica.id, from_states=[State.STOPPING],
                          to_state=State.STOPPED, message="engine stopped, port freed",
                          stopped_at=timezone.now(), pid=None, log_tail=supervisor.tail(
                              log_path(replica.id)))


def check_engines() -> None:
    """Called by the agent's heartbeat: publish each running engine's last log lines (the API
    shows them while it loads), and fail a ready engine that exited; the reconciler restarts
    it after a backoff."""
    with _engines_lock:
        exited = {rid: p for rid, p in _engines.items() if p.poll() is not None}
        for rid in exited:
            _engines.pop(rid)
        running = list(_engines)
    for rid in running:
        Replica.objects.filter(id=rid, state__in=[State.LOADING, State.READY]).update(
            log_tail=supervisor.tail(log_path(rid)))
    for rid, process in exited.items():
        # The API server is gone; its engine-core children may not be. End the whole group.
        processes.stop_group(process.pid, grace=settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
        _record_failure(UUID(rid), f"the engine exited with status {process.returncode}",
                        log_path(rid), from_states=[State.READY])


def do_fail_replicas_of_previous_agent(*, node: Node) -> int:
    """On agent start: engines of the agent's previous life died with it."""
    orphans = Replica.objects.filter(node=node, state__in=[State.LOADING, State.READY])
    count = 0
    for replica in orphans:
        count += _record_failure(replica.id, "the node agent restarted and its engines with it",
                                 log_path(replica.id), from_states=[State.LOADING, State.READY])
    return count


def _record_failure(replica_id: UUID, reason: str, log: Path, *, from_states: list[str]) -> bool:
    last_lines = supervisor.tail(log)
    full = f"{reason}. Last engine log lines:\n{last_lines}" if last_lines else reason
    logger.warning("replica %s failed: %s", replica_id, reason)
    return do_fail_replica(replica_id=replica_id, from_states=from_states, reason=reason,
                           failure_reason=full, log_tail=last_lines, pid=None)


def _forget_and_stop(replica_id: str, process: Popen) -> None:
    with _engines_lock:
        _engines.pop(replica_id, None)
    processes.stop_group(process.pid, grace=settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
    process.wait(timeout=10)
