"""The node agent's side of a replica: start its engine, watch it, stop it.

Runs inside `manage.py node_agent` (Celery threads on queue node.<name>). Engines are this
process's children, each in its own process group, told to die with the agent and marked
with the agent's owner (engine.processes.owner_of) in their environment. Dying with the
agent is not enough (a loading engine ignores the signal), so the agent finds its engines by
that marker: it stops them all when it shuts down and, when it starts, whatever its previous
run left; each heartbeat reports them and stops those kvrun no longer expects. Stops run off
the heartbeat's thread, and a replica is settled only once its engine is confirmed gone.

What the agent holds while it runs (its engines, the stops under way, whether it is shutting
down) belongs to one NodeAgent, which the command builds and serves; the node's Celery tasks
reach it through serving(). Tests build a fresh one.
"""

import asyncio
import logging
import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from subprocess import Popen
from uuid import UUID

import httpx
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from endpoints.lifecycle import (
    do_fail_replica,
    do_note_replica,
    do_set_replica_progress,
    do_transition_replica,
)
from endpoints.models import Adapter, Endpoint, ModelSpec, Node, Replica, State
from endpoints.states import PROGRESS
from engine import kv_policy, metrics, model_cache, offload_check, processes, sandbox, supervisor
from engine.sizing import CPU, GIB, GPU
from fleet.replicas import AGENT_AT_WORK, failure_text
from fleet.reports import do_record_node_heartbeat
from kvrun.common.digests import engine_api_key
from nodes import weights
from telemetry.services import do_record_engine_samples

logger = logging.getLogger(__name__)

# The agent's own supervisor (the launcher, Docker) gives it 10 s to stop.
SHUTDOWN_GRACE_SECONDS = 5.0
# What reading one engine's /metrics may cost the agent. An engine runs weights (and, with
# remote code, code) its tenant chose, so its answer is bounded: past the time, or the size
# (vLLM's own is tens of KiB), it is dropped. An engine busy with a long prefill may answer
# late; the next scrape comes soon.
SCRAPE_TIMEOUT_SECONDS = 2.0
SCRAPE_MOST_BYTES = 4 * 1024 * 1024
SCRAPE_MOST_ENGINES_AT_ONCE = 16
# After a gateway's route cache would have expired, before an engine is taken as dropped.
ROUTE_MARGIN_SECONDS = 0.5
LOG_SWEEP_SECONDS = 3600.0


class NodeAgent:
    """The node agent of node `name` in this process: the engines it started (its children)
    and what it is doing to them. Its methods run on Celery's threads, the heartbeat's thread
    and background stops at once."""

    def __init__(self, *, name: str) -> None:
        self.name = name
        self.engines: dict[str, Popen] = {}  # by replica id
        self.cpu_cores: dict[str, tuple[int, ...]] = {}  # a CPU engine's bound cores, by replica
        # Held while an engine is spawned, and while a heartbeat finds the engines and reports
        # them, so that no engine appears between the two.
        self._lock = threading.Lock()
        self._stopping: set[int] = set()  # process groups a stop is already on
        self._shutting_down = threading.Event()
        self._next_log_sweep = 0.0  # monotonic
        # By replica: held while its engine's adapters are changed, so the last change to
        # finish reports what it serves.
        self._adapter_locks: dict[str, threading.Lock] = {}

    def start_replica(self, replica_id: str) -> None:
        """Start the replica's engine and wait until it serves. A second delivery of the same start
        finds the replica no longer `starting` and does nothing: one engine per replica."""
        replica = (Replica.objects.select_related("endpoint__model", "endpoint__gpu_type", "node")
                   .filter(id=replica_id).first())
        if replica is None:
            return
        log = log_path(replica.id)
        coming_from, downloaded = State.STARTING, None
        if weights.needs_download(replica.endpoint.model):
            began = time.monotonic()
            if not self._download(replica, log):
                return
            coming_from, downloaded = State.DOWNLOADING, time.monotonic() - began
        port = processes.free_port(replica.node.address)
        # The engine starts with the endpoint's policy as read above, and says which one.
        if not do_transition_replica(replica_id=replica.id, from_states=[coming_from],
                                     to_state=State.LOADING, message="starting the engine",
                                     port=port, policy_version=replica.endpoint.policy_version,
                                     download_seconds=downloaded, download_done_at=None,
                                     adapters=[]):
            return
        process = None
        try:
            do_set_replica_progress(replica_id=replica.id, state=State.LOADING,
                                    stage="preparing the model", percent=45)
            spec = spec_for(replica, port)
            with self._lock:
                # A stop (or the node's loss, or the agent's shutdown) that came while the model
                # was prepared found no engine to stop: none may start after it.
                if self._shutting_down.is_set() or not Replica.objects.filter(
                        id=replica.id, state=State.LOADING).exists():
                    return
                if spec.device == CPU and settings.KVRUN_NODE_CPU_CORES_PER_ENGINE:
                    spec = replace(spec, cpu_cores=self._cores_for(str(replica.id)))
                process = supervisor.start(spec, log)
                self.engines[str(replica.id)] = process
            Replica.objects.filter(id=replica.id).update(pid=process.pid)
            do_set_replica_progress(replica_id=replica.id, state=State.LOADING,
                                    stage="loading weights and allocating the KV cache", percent=50)
            supervisor.wait_ready(
                host=spec.host, port=port, served_model_name=spec.served_model_name,
                api_key=spec.api_key,
                alive=lambda: process.poll() is None,
                timeout=settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS,
                on_progress=lambda stage: do_set_replica_progress(
                    replica_id=replica.id, state=State.LOADING, stage="engine healthy, loading API",
                    percent=90),
            )
        except (supervisor.EngineFailed, OSError, ValueError) as exc:
            # ValueError: a KV policy this node's vLLM cannot run (engine.kv_policy says why).
            if process is not None:
                self._forget_and_stop(str(replica.id), process)
            _record_failure(replica.id, str(exc), log, from_states=[State.LOADING])
            return
        # Adapters before the first request, then again once ready: one added between the
        # two was sent to the replicas ready when it was added, which this was not yet.
        self._serve_adapters(replica, host=spec.host, port=port)
        capacity = supervisor.read_kv_capacity(log.read_text(errors="replace"))
        ready = do_transition_replica(
            replica_id=replica.id, from_states=[State.LOADING], to_state=State.READY,
            message=f"ready on port {port}"
            + (f", KV cache {capacity:,} tokens" if capacity else "")
            + (f", cores {','.join(map(str, spec.cpu_cores))}" if spec.cpu_cores else ""),
            kv_cache_tokens=capacity, ready_at=timezone.now(), restarts=0,
            log_tail=supervisor.tail(log),
        )
        if ready:
            self._serve_adapters(replica, host=spec.host, port=port)
        if ready and (spec.kv_policy.host_tier_gib or spec.kv_policy.disk_tier_gib):
            _in_background(_test_offload, replica.id, spec)

    def sync_adapters(self, replica_id: str) -> None:
        """Make a ready replica's engine serve exactly its endpoint's adapters now: load those
        added (fetching their files first), unload those removed."""
        replica = (Replica.objects.select_related("endpoint", "node")
                   .filter(id=replica_id, state=State.READY, port__isnull=False).first())
        if replica is not None and replica.node is not None and replica.port is not None:
            self._serve_adapters(replica, host=replica.node.address, port=replica.port)

    def _serve_adapters(self, replica: Replica, *, host: str, port: int) -> None:
        """An adapter that cannot be fetched or that the engine refuses becomes an event of
        the replica; the others are served. One the engine holds from other files (removed,
        then added again under its name) is loaded anew. The replica's `adapters` say what it
        serves."""
        endpoint = replica.endpoint
        if not endpoint.lora_adapters:
            return
        api_key = engine_api_key(replica_id=replica.id, node_id=replica.node_id)
        with self._lock:
            lock = self._adapter_locks.setdefault(str(replica.id), threading.Lock())
        with lock:  # one change of this engine's adapters at a time; other replicas go on
            try:
                wanted = {f"{endpoint.name}:{adapter.name}": adapter
                          for adapter in Adapter.objects.filter(endpoint_id=endpoint.id)}
                served = supervisor.served_adapters(
                    host=host, port=port, api_key=api_key, served_model_name=endpoint.name)
                visible = {name: cache_dir(replica.id) / sandbox.ADAPTERS / adapter.folder
                           for name, adapter in wanted.items()}
                stale = {name for name, folder in served.items()
                         if name not in wanted or folder != str(visible[name])}
                for name in sorted(stale):
                    supervisor.unload_adapter(host=host, port=port, api_key=api_key, name=name)
                for name in sorted(wanted.keys() - (served.keys() - stale)):
                    try:
                        folder = sandbox.offer(
                            weights.adapter_dir(wanted[name], node_name=self.name),
                            visible[name])
                        supervisor.load_adapter(host=host, port=port, api_key=api_key,
                                                name=name, path=str(folder))
                    except Exception as exc:  # whatever the cause, only this adapter fails
                        logger.warning("replica %s: adapter %s not served: %s", replica.id,
                                       name, exc)
                        do_note_replica(replica_id=replica.id, message=(
                            f"adapter {wanted[name].name} could not be served: "
                            f"{weights.failure_reason(exc)}"))
                now = supervisor.served_adapters(host=host, port=port, api_key=api_key,
                                                 served_model_name=endpoint.name)
            except (httpx.HTTPError, supervisor.EngineFailed) as exc:
                # The engine stopped answering: the heartbeat finds out what became of it.
                logger.warning("replica %s: its adapters could not be changed: %s", replica.id,
                               exc)
                return
            Replica.objects.filter(id=replica.id).update(
                adapters=sorted(name.partition(":")[2] for name in now))

    def _download(self, replica: Replica, log: Path) -> bool:
        """Fetch the replica's weights into this node's model cache (starting → downloading),
        showing how far it is as the replica's stage. False, with the replica settled, when
        it cannot be fetched; False too when the replica was stopped meanwhile (what was
        fetched is kept for the next start)."""
        model = replica.endpoint.model
        if not do_transition_replica(
                replica_id=replica.id, from_states=[State.STARTING], to_state=State.DOWNLOADING,
                message=f"downloading the weights of {model.hf_repo}"
                + (f" at {model.hf_commit[:12]}" if model.hf_commit else "")):
            return False

        began = time.monotonic()
        heard: list[model_cache.Progress] = []

        def show(progress: model_cache.Progress) -> bool:
            heard[:] = [progress]
            left = progress.seconds_left
            return do_set_replica_progress(
                replica_id=replica.id, state=State.DOWNLOADING, stage=progress.describe(),
                percent=PROGRESS[State.DOWNLOADING] + progress.percent * 15 // 100,
                download_done_at=None if left is None else timezone.now() + timedelta(
                    seconds=left))

        try:
            pinned = weights.fetch(model=model, node_name=self.name, on_progress=show)
        except model_cache.Cancelled:
            return False
        except Exception as exc:  # any cause is a failed start, counted and restarted
            logger.exception("replica %s: downloading its weights failed", replica.id)
            _record_failure(replica.id, f"the weights could not be downloaded: "
                            f"{weights.failure_reason(exc)}", log,
                            from_states=[State.DOWNLOADING])
            return False
        do_note_replica(replica_id=replica.id, message=heard[-1].describe_done(
            time.monotonic() - began) if heard else "the weights were in this node's cache")
        replica.endpoint.model = pinned
        return True

    def pull_model(self, model_id: int) -> None:
        """Download a model's weights into this node's cache ahead of any replica (an
        operator's pre-pull), on a thread of its own: the node's task threads stay free for
        starts and stops. A model with local weights, or cached already, needs nothing."""
        model = ModelSpec.objects.filter(id=model_id).first()
        if model is not None and weights.needs_download(model):
            _in_background(self._pull, model)

    def _pull(self, model: ModelSpec) -> None:
        try:
            weights.fetch(model=model, node_name=self.name, on_progress=lambda progress: True)
        except Exception as exc:  # an operator's pull: the log says why; nothing else waits
            logger.warning("pre-pulling %s failed: %s", model.hf_repo,
                           weights.failure_reason(exc))

    def stop_replica(self, replica_id: str) -> None:
        """Stop the replica's engine: SIGTERM, SIGKILL after the grace period; wait for the port.
        The replica is stopped only once no process of its engine is left; until then it stays
        stopping, holding its devices, and the reconciler sends the stop again."""
        replica = Replica.objects.select_related("node").filter(id=replica_id).first()
        if replica is None or replica.state != State.STOPPING or replica.node is None:
            return
        _drain(replica)
        marker = owner(replica.node.name)
        with self._lock:
            process = self.engines.pop(str(replica.id), None)
            groups = processes.running_engines(marker).get(str(replica.id), set())
        children = [process] if process is not None else []
        self._stop_and_reap(groups | {child.pid for child in children}, children,
                       grace=settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
        if str(replica.id) in processes.running_engines(marker):
            logger.warning("replica %s: its engine outlived SIGKILL; the stop will come again",
                           replica.id)
            return
        deadline = time.monotonic() + 10
        host = replica.node.address
        while (replica.port and not processes.port_is_free(replica.port, host)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        shutil.rmtree(cache_dir(replica.id), ignore_errors=True)
        do_transition_replica(replica_id=replica.id, from_states=[State.STOPPING],
                              to_state=State.STOPPED, message="engine stopped, port freed",
                              stopped_at=timezone.now(), pid=None, log_tail=supervisor.tail(
                                  log_path(replica.id)))

    def beat(self) -> bool:
        """One heartbeat of the node `name`: report the engines it runs and stop, in the
        background, those kvrun no longer expects; publish each engine's last log lines (the API
        shows them while it loads); fail a ready engine that exited once its group is gone (the
        reconciler restarts it after a backoff). Returns False when the node must register again.
        Nothing here waits for an engine to stop."""
        with self._lock:
            running = processes.running_engines(owner(self.name))
            unexpected = do_record_node_heartbeat(name=self.name, engines=running)
            if unexpected is None:
                return False
            children = {rid: self.engines.pop(rid) for rid in unexpected
                        if rid in self.engines and self.engines[rid].pid in running[rid]}
        for rid in unexpected:
            logger.warning("replica %s: kvrun no longer expects its engine here; stopping it", rid)
            _in_background(self._stop_unexpected, rid, running[rid],
                           [children[rid]] if rid in children else [])
        with self._lock:
            exited = {rid: p for rid, p in self.engines.items() if p.poll() is not None}
            for rid in exited:
                self.engines.pop(rid)
            live = list(self.engines)
        for rid in live:
            Replica.objects.filter(id=rid, state__in=[State.LOADING, State.READY]).update(
                log_tail=supervisor.tail(log_path(rid)))
        for rid, process in exited.items():
            _in_background(self._fail_once_stopped, rid, process)
        if time.monotonic() >= self._next_log_sweep:
            self._next_log_sweep = time.monotonic() + LOG_SWEEP_SECONDS
            delete_old_logs()
            delete_unused_compile_caches()
        return True

    def stop_all_engines(self) -> None:
        """On agent shutdown: stop every engine, whatever it is doing (a start waiting on one then
        ends), within the time the agent's own supervisor gives the agent."""
        with self._lock:
            self._shutting_down.set()
            children = list(self.engines.values())
            groups = set().union(*processes.running_engines(owner(self.name)).values())
        # Every group, those a background stop is on included: the agent may exit before it ends.
        processes.stop_groups(groups | {child.pid for child in children},
                              grace=min(SHUTDOWN_GRACE_SECONDS,
                                        settings.KVRUN_ENGINE_STOP_GRACE_SECONDS))
        for child in children:
            child.poll()

    def _cores_for(self, replica_id: str) -> tuple[int, ...]:
        """KVRUN_NODE_CPU_CORES_PER_ENGINE cores for a new CPU engine: those the fewest of
        this agent's running engines are bound to. The caller holds self._lock."""
        self.cpu_cores = {rid: cores for rid, cores in self.cpu_cores.items()
                          if rid in self.engines}
        used = Counter(core for cores in self.cpu_cores.values() for core in cores)
        ranked = sorted(os.sched_getaffinity(0), key=lambda core: (used[core], core))
        self.cpu_cores[replica_id] = tuple(
            sorted(ranked[:settings.KVRUN_NODE_CPU_CORES_PER_ENGINE]))
        return self.cpu_cores[replica_id]

    def _forget_and_stop(self, replica_id: str, process: Popen) -> None:
        with self._lock:
            self.engines.pop(replica_id, None)
        self._stop_and_reap({process.pid}, [process], settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)

    def _fail_once_stopped(self, replica_id: str, process: Popen) -> None:
        # The API server is gone; its engine-core children may not be: end the whole group
        # before the failure frees the replica's devices.
        self._stop_and_reap({process.pid}, [process], settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
        _record_failure(UUID(replica_id), f"the engine exited with status {process.returncode}",
                        log_path(replica_id), from_states=[State.READY])

    def _stop_unexpected(self, replica_id: str, groups: set[int], children: list[Popen]) -> None:
        self._stop_and_reap(groups, children, settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
        shutil.rmtree(cache_dir(replica_id), ignore_errors=True)

    def _stop_and_reap(self, groups: set[int], children: list[Popen], grace: float) -> None:
        """Stop the process groups (leaving one a stop is already on to it), then collect the exit
        status of those that are this agent's children."""
        with self._lock:
            mine = groups - self._stopping
            self._stopping.update(mine)
        try:
            processes.stop_groups(mine, grace=grace)
        finally:
            with self._lock:
                self._stopping.difference_update(mine)
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("engine %s outlived SIGKILL", child.pid)


_serving: NodeAgent | None = None


def serve(agent: NodeAgent) -> None:
    """Make `agent` the one this process's node tasks act through (manage.py node_agent)."""
    global _serving
    _serving = agent


def serving() -> NodeAgent:
    """The node agent this process serves; a node task runs nowhere else."""
    if _serving is None:
        raise RuntimeError("node tasks run only in manage.py node_agent, which serves a node")
    return _serving


def log_path(replica_id: UUID | str) -> Path:
    return Path(settings.KVRUN_ENGINE_LOG_DIR) / f"{replica_id}.log"


def cache_root() -> Path:
    return Path(settings.KVRUN_STATE_DIR) / "kv"


def cache_dir(replica_id: UUID | str) -> Path:
    """The replica's KV tier on disk and its config: deleted when the replica stops or fails,
    so that nothing of a tenant's cache outlives its engine."""
    return cache_root() / str(replica_id)


def compile_cache_root() -> Path:
    return Path(settings.KVRUN_STATE_DIR) / "compile-cache"


def compile_cache_dir(organization_id: UUID | str) -> Path:
    """The compile caches of an organisation's engines on this node: shared by its own
    engines only (an engine could plant code in them), kept while it has endpoints."""
    return compile_cache_root() / str(organization_id)


def delete_unused_compile_caches() -> int:
    """Delete the compile caches of organisations without an endpoint; returns how many."""
    root = compile_cache_root()
    found = [path for path in root.iterdir() if _is_uuid(path.name)] if root.is_dir() else []
    alive = {str(organization_id) for organization_id in Endpoint.objects.filter(
        organization_id__in=[path.name for path in found], deleted_at=None).values_list(
        "organization_id", flat=True)}
    gone = [path for path in found if path.name not in alive]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return len(gone)


def owner(node_name: str) -> str:
    """The marker of this agent's engines."""
    return processes.owner_of(node_name, settings.KVRUN_STATE_DIR)


def spec_for(replica: Replica, port: int) -> supervisor.EngineSpec:
    endpoint = replica.endpoint
    cpu = endpoint.gpu_type.slug == CPU
    return supervisor.EngineSpec(
        model_dir=str(weights.weights_dir(endpoint.model)),
        trust_remote_code=endpoint.model.trust_remote_code,
        served_model_name=endpoint.name,
        host=replica.node.address,
        port=port,
        max_model_len=endpoint.context_length,
        max_num_seqs=endpoint.concurrency,
        device=CPU if cpu else GPU,
        tensor_parallel=endpoint.gpu_count,
        kv_policy=endpoint.kv_policy,
        cache_dir=str(cache_dir(replica.id)),
        compile_cache=str(compile_cache_dir(endpoint.organization_id)),
        vllm_version=kv_policy.installed_version(CPU if cpu else GPU),
        # Endpoints sized before the exact budget had a whole GiB.
        cpu_kv_cache_bytes=endpoint.sizing.get("cpu_kv_cache_bytes") or GIB,
        device_indices=tuple(replica.device_indices),
        api_key=engine_api_key(replica_id=replica.id, node_id=replica.node_id),
        owner=owner(replica.node.name),
        replica=str(replica.id),
        lora_adapters=endpoint.lora_adapters,
        lora_max_rank=endpoint.lora_max_rank,
        lora_host_adapters=endpoint.lora_host_adapters,
    )


def _test_offload(replica_id: UUID, spec: supervisor.EngineSpec) -> None:
    """The offload self-test on a replica just ready with a KV tier; its verdict becomes the
    replica's event."""
    try:
        verdict = offload_check.run(
            base_url=f"http://{spec.host}:{spec.port}", api_key=spec.api_key,
            model=spec.served_model_name, disk_tier=bool(spec.kv_policy.disk_tier_gib),
            prefix_caching=spec.kv_policy.prefix_caching, context_length=spec.max_model_len)
        message = verdict.message
    except httpx.HTTPError as exc:
        message = f"KV tier self-test could not run: {exc}"
    do_note_replica(replica_id=replica_id, message=message)


def _drain(replica: Replica) -> None:
    """Let a stopping replica's engine finish its work before it stops: first until every
    gateway has dropped it (they route to ready replicas only, and hold their routes for
    KVRUN_GATEWAY_ROUTE_CACHE_SECONDS), then until its requests in flight have finished, at
    most KVRUN_ENGINE_DRAIN_SECONDS in all. An engine that does not answer is not waited
    for. Without this, a rolling change or a scale-down cuts requests off mid-answer."""
    deadline = time.monotonic() + settings.KVRUN_ENGINE_DRAIN_SECONDS
    time.sleep(min(settings.KVRUN_GATEWAY_ROUTE_CACHE_SECONDS + ROUTE_MARGIN_SECONDS,
                   settings.KVRUN_ENGINE_DRAIN_SECONDS))
    while time.monotonic() < deadline and replica.port:
        busy = _read_metrics(replica.id, replica.node.address, replica.port,
                             engine_api_key(replica_id=replica.id, node_id=replica.node.id))
        if busy is None or busy.running + busy.waiting == 0:
            return
        time.sleep(0.5)


def delete_old_logs() -> int:
    """Delete the engine logs of replicas stopped for good (or gone) that were last written
    KVRUN_ENGINE_LOG_KEPT_DAYS ago or more: every wake from zero and every scale-up leaves
    one. A failed replica's is kept (it restarts under its id, appending). Returns how many
    it deleted."""
    cutoff = time.time() - settings.KVRUN_ENGINE_LOG_KEPT_DAYS * 86400
    old: dict[str, Path] = {}
    try:
        with os.scandir(settings.KVRUN_ENGINE_LOG_DIR) as entries:
            for entry in entries:
                stem = entry.name.removesuffix(".log")
                if entry.name.endswith(".log") and _is_uuid(stem) and (
                        entry.stat().st_mtime < cutoff):
                    old[stem] = Path(entry.path)
    except FileNotFoundError:  # no engine has started here yet, or a log just went
        return 0
    kept = {str(replica_id) for replica_id in Replica.objects.filter(id__in=old).exclude(
        state=State.STOPPED).values_list("id", flat=True)}
    for stem in old.keys() - kept:
        old[stem].unlink(missing_ok=True)
    return len(old.keys() - kept)


def scrape(*, name: str) -> int:
    """Read the /metrics of each ready engine of the node `name` into the database
    (telemetry), the engines at once, so that a slow one delays no other's sample; an engine
    whose answer is late or too large (_read_one) is left out this time. Returns how many
    samples were stored."""
    ready = list(Replica.objects.filter(node__name=name, state=State.READY).values_list(
        "id", "endpoint_id", "node__address", "port", "node_id"))
    read = asyncio.run(_read_all([
        (replica_id, address, port, engine_api_key(replica_id=replica_id, node_id=node_id))
        for replica_id, _, address, port, node_id in ready]))
    return do_record_engine_samples(samples=[
        (replica_id, endpoint_id, at, snapshot)
        for (replica_id, endpoint_id, *_), (snapshot, at) in zip(ready, read, strict=True)
        if snapshot is not None])


def _read_metrics(replica_id: UUID | str, address: str, port: int, api_key: str
                  ) -> metrics.EngineSnapshot | None:
    """One engine's /metrics now, as _read_one reads it."""
    return asyncio.run(_read_all([(replica_id, address, port, api_key)]))[0][0]


async def _read_all(engines: list[tuple[UUID | str, str, int, str]]
                    ) -> list[tuple[metrics.EngineSnapshot | None, datetime]]:
    """Each engine's /metrics (None where _read_one gives none) and when it was read, at
    most SCRAPE_MOST_ENGINES_AT_ONCE at a time."""
    at_once = asyncio.Semaphore(SCRAPE_MOST_ENGINES_AT_ONCE)
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_SECONDS) as client:
        async def read(replica_id: UUID | str, address: str, port: int, api_key: str
                       ) -> tuple[metrics.EngineSnapshot | None, datetime]:
            async with at_once:
                try:
                    snapshot = await _read_one(client, replica_id, address, port, api_key)
                except Exception:  # one engine's answer never costs the others their samples
                    logger.exception("the /metrics of replica %s could not be read", replica_id)
                    snapshot = None
            return snapshot, timezone.now()
        return await asyncio.gather(*(read(*engine) for engine in engines))


async def _read_one(client: httpx.AsyncClient, replica_id: UUID | str, address: str, port: int,
                    api_key: str) -> metrics.EngineSnapshot | None:
    """The engine's /metrics now. None when it does not answer, or not as Prometheus text,
    or when its whole answer, headers included, takes more than SCRAPE_TIMEOUT_SECONDS, is
    larger than SCRAPE_MOST_BYTES, or comes compressed (a small body can unpack to any
    size)."""
    body = bytearray()
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT_SECONDS), client.stream(
                "GET", f"http://{address}:{port}/metrics",
                headers={"Authorization": f"Bearer {api_key}",
                         "Accept-Encoding": "identity"}) as response:
            response.raise_for_status()
            if response.headers.get("content-encoding", "identity") != "identity":
                return _dropped(replica_id, "compressed")
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > SCRAPE_MOST_BYTES:
                    return _dropped(replica_id, f"larger than {SCRAPE_MOST_BYTES:,} bytes")
        return metrics.snapshot(body.decode())
    except TimeoutError:
        return _dropped(replica_id, f"longer than {SCRAPE_TIMEOUT_SECONDS:g} s")
    except (httpx.HTTPError, ValueError):  # no answer, or text that is not Prometheus's
        return None


def _dropped(replica_id: UUID | str, why: str) -> None:
    logger.warning("the /metrics of replica %s was dropped: %s", replica_id, why)
    return None


def stop_engines_left_behind(*, name: str) -> int:
    """On agent start: stop every engine the agent's previous run left (a loading engine
    outlives a killed agent), found by their marker, and delete the KV caches on disk of every
    replica the node ever ran, since none of them runs now. Returns how many replicas the
    stopped engines served."""
    left = processes.running_engines(owner(name))
    processes.stop_groups(set().union(*left.values()),
                          grace=settings.KVRUN_ENGINE_STOP_GRACE_SECONDS)
    caches = {folder.name: folder for folder in cache_root().iterdir()
              if _is_uuid(folder.name)} if cache_root().is_dir() else {}
    for replica_id in Replica.objects.filter(node__name=name, id__in=caches).values_list(
            "id", flat=True):
        shutil.rmtree(caches[str(replica_id)], ignore_errors=True)
    return len(left)


def _is_uuid(text: str) -> bool:
    try:
        UUID(text)
    except ValueError:
        return False
    return True


def do_fail_replicas_of_previous_agent(*, node: Node) -> int:
    """On agent start: the engines of the agent's previous life are gone (it stopped those
    left behind first)."""
    orphans = Replica.objects.filter(node=node, state__in=AGENT_AT_WORK)
    count = 0
    for replica in orphans:
        count += _record_failure(replica.id, "the node agent restarted and its engines with it",
                                 log_path(replica.id), from_states=AGENT_AT_WORK)
    return count


def _record_failure(replica_id: UUID, reason: str, log: Path, *,
                    from_states: Collection[str]) -> bool:
    shutil.rmtree(cache_dir(replica_id), ignore_errors=True)  # its engine is gone
    last_lines = supervisor.tail(log)
    logger.warning("replica %s failed: %s", replica_id, reason)
    return do_fail_replica(replica_id=replica_id, from_states=from_states, reason=reason,
                           failure_reason=failure_text(reason, last_lines), log_tail=last_lines,
                           pid=None)


def _in_background(target: Callable[..., None], *args: object) -> None:
    threading.Thread(target=_logged, args=(target, *args), daemon=True).start()


def _logged(target: Callable[..., None], *args: object) -> None:
    try:
        target(*args)
    except Exception:  # a stop: the next heartbeat finds what is left and tries again
        logger.exception("the agent's background work failed")
    finally:
        close_old_connections()
