"""The node agent's side of a replica: start its engine, watch it, stop it.

Runs in `python -m nodes` (nodes.main), which follows the node's work (the channel's long
poll) and hands it to take_work. Everything the agent learns of its replicas, and everything it
reports, goes through the node channel (nodes.channel), with the node's own credential: it
reads no table and holds no secret of the control plane. Engines are this process's
children, each in its own process group, told to die with the agent and marked with the
agent's owner (engine.processes.owner_of) on their sandbox's command line. Dying with the
agent is not enough (a loading engine ignores the signal), so the agent finds its engines by
that marker: it stops them all when it shuts down and, when it starts, whatever its previous
run left; each heartbeat reports them and stops those kvrun no longer expects. Stops run off
the heartbeat's thread, and a replica is settled only once its engine is confirmed gone.

What the agent holds while it runs (its engines, their ports and keys, the stops under way,
whether it is shutting down) belongs to one NodeAgent, which nodes.main builds. Tests build
a fresh one.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from subprocess import Popen
from typing import Any
from uuid import UUID

import httpx

from engine import (
    kv_policy,
    metrics,
    model_cache,
    offload_check,
    processes,
    sandbox,
    supervisor,
    tasks,
    tls,
)
from engine.kv_policy import KVPolicy
from engine.sizing import CPU, GPU
from engine.tls import EngineAddress
from nodes import weights
from nodes.channel import AT_WORK, ChannelDown, ChannelRefused, NodeChannel, NodeRevoked, State
from nodes.config import AgentConfig, Timings

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
# An organisation's compile cache outlives its last engine here by this long: an endpoint
# scaled to zero wakes without compiling again.
COMPILE_CACHE_KEPT_DAYS = 7.0


class NodeAgent:
    """The node agent of node `name`, configured by `config`, with the control plane's
    `timings`: the engines it
    started (its children) and what it is doing to them. Its methods run on the threads of
    its work, the heartbeat's thread and background stops at once."""

    def __init__(self, *, name: str, config: AgentConfig, channel: NodeChannel,
                 timings: Timings) -> None:
        self.name = name
        self.config = config
        self.address = config.address
        self.channel = channel
        self.timings = timings
        self.engines: dict[str, Popen] = {}  # by replica id
        self.listening: dict[str, EngineAddress] = {}  # by replica id, once its engine is spawned
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
        self._busy: set[str] = set()  # the steps under way (take_work), as "step subject"
        self._busy_lock = threading.Lock()
        self._stops_asked: set[str] = set()  # replicas a stop came for (held with _lock)
        # The one thread engines are spawned from, alive as long as the agent: an engine's
        # sandbox dies with the thread that started it (--die-with-parent), and the thread of
        # a start ends once its engine serves.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        self._adapters_seen: dict[str, list[list[str]]] = {}  # by ready replica

    def take_work(self, work: dict[str, Any]) -> None:
        """Act on the node's work as the control plane states it now (fleet.feed): start each
        replica starting here, stop each one stopping, make each ready one's engine serve
        its endpoint's adapters when they changed, take each pull that waits. Each on a
        thread of its own, and none twice at once: the same work read again while a start
        or a stop is on adds nothing."""
        for replica in work["replicas"]:
            rid, state = replica["id"], replica["state"]
            if state == State.STARTING:
                self._once(self.start_replica, rid)
            elif state == State.STOPPING:  # a start still on gives up once it is stopped
                self._once(self.stop_replica, rid)
            elif state == State.READY and self._adapters_seen.get(rid) != replica["adapters"]:
                if self._once(self.sync_adapters, rid):
                    self._adapters_seen[rid] = replica["adapters"]
            elif state in (State.DOWNLOADING, State.LOADING) and rid not in self.engines and (
                    not self._under_way(self.start_replica, rid)):
                # A start this agent lost (the control plane away when it reported a step).
                self._once(self._give_up_start, rid)
        for model_id in work["pulls"]:
            self._once(self.pull_model, model_id)

    def _under_way(self, step: Callable[[Any], None], subject: Any) -> bool:
        with self._busy_lock:
            return f"{step.__name__} {subject}" in self._busy

    def _once(self, step: Callable[[Any], None], subject: Any) -> bool:
        """step(subject) on a thread of its own, unless the same step on the same subject
        still runs; whether it was started."""
        key = f"{step.__name__} {subject}"
        with self._busy_lock:
            if key in self._busy:
                return False
            self._busy.add(key)

        def run() -> None:
            try:
                step(subject)
            finally:
                with self._busy_lock:
                    self._busy.discard(key)
        _in_background(run)
        return True

    def _give_up_start(self, replica_id: str) -> None:
        self._record_failure(
            replica_id, "the node agent lost track of this start (the control plane did not "
                        "answer while it reported a step)", self.config.log_path(replica_id),
            from_states=[State.DOWNLOADING, State.LOADING])

    def start_replica(self, replica_id: str) -> None:
        """Start the replica's engine and wait until it serves. A second delivery of the same start
        finds the replica no longer `starting` and does nothing: one engine per replica. The
        control plane away while a step is reported ends the start (ChannelDown), its engine
        stopped; take_work fails the replica once the control plane answers again."""
        with self._lock:
            self._stops_asked.discard(replica_id)  # one of an earlier life of the replica
        spec = self.channel.replica(replica_id)
        if spec is None or spec["state"] != State.STARTING:
            return
        log = self.config.log_path(replica_id)
        coming_from = State.STARTING
        if weights.needs_download(spec["model"], config=self.config):
            pinned = self._download(spec, log)
            if pinned is None:
                return
            spec["model"], coming_from = pinned, State.DOWNLOADING
        port = processes.free_port(self.address)
        # The engine starts with the endpoint's policy and its model's parsers as read above,
        # and says which.
        if not self.channel.move(replica_id, from_states=[coming_from], to_state=State.LOADING,
                                 message="starting the engine", port=port,
                                 policy_version=spec["policy_version"],
                                 tool_call_parser=spec["model"]["tool_call_parser"],
                                 reasoning_parser=spec["model"]["reasoning_parser"]):
            return
        try:
            self._spawn_and_serve(spec, port, log)
        except ChannelDown:
            with self._lock:
                process = self.engines.get(replica_id)
            if process is not None:
                self._forget_and_stop(replica_id, process)
            raise

    def _spawn_and_serve(self, spec: dict[str, Any], port: int, log: Path) -> None:
        replica_id, process = spec["id"], None
        try:
            if not self.channel.progress(replica_id, state=State.LOADING,
                                         stage="preparing the model", percent=45):
                return  # stopped meanwhile
            engine = self.engine_spec(spec, port)
            certified = self._certify(replica_id, engine)
            if certified is None:
                return  # stopped meanwhile
            engine, address = certified
            with self._lock:
                # A stop (or the agent's shutdown) that came while the model was prepared
                # found no engine to stop: none may start after it.
                if self._shutting_down.is_set() or replica_id in self._stops_asked:
                    # Its stop may have cleared the replica's directory before the key
                    # was written there.
                    shutil.rmtree(self.config.kv_dir(replica_id), ignore_errors=True)
                    return
                if engine.device == CPU and self.config.cpu_cores_per_engine:
                    engine = replace(engine, cpu_cores=self._cores_for(replica_id))
                process = self._spawner.submit(supervisor.start, engine, log).result()
                self.engines[replica_id] = process
                self.listening[replica_id] = address
            self.channel.record_pid(replica_id, pid=process.pid)
            self.channel.progress(replica_id, state=State.LOADING, percent=50,
                                  stage="loading weights and allocating the KV cache")
            supervisor.wait_ready(
                address=address, served_model_name=engine.served_model_name,
                task=engine.task, alive=lambda: process.poll() is None,
                timeout=self.timings.start_timeout_seconds,
                on_progress=lambda stage: self.channel.progress(
                    replica_id, state=State.LOADING, stage="engine healthy, loading API",
                    percent=90),
            )
        except (supervisor.EngineFailed, OSError, ValueError) as exc:
            # ValueError: a KV policy this node's vLLM cannot run (engine.kv_policy says why).
            if process is not None:
                self._forget_and_stop(replica_id, process)
            self._record_failure(replica_id, str(exc), log, from_states=[State.LOADING])
            return
        # Adapters before the first request, then again once ready: one added between the
        # two was sent to the replicas ready when it was added, which this was not yet.
        self._serve_adapters(replica_id, spec["endpoint"])
        capacity = supervisor.read_kv_capacity(log.read_text(errors="replace"))
        ready = self.channel.move(
            replica_id, from_states=[State.LOADING], to_state=State.READY,
            message=f"ready on port {port}"
            + (f", KV cache {capacity:,} tokens" if capacity else "")
            + (f", cores {','.join(map(str, engine.cpu_cores))}" if engine.cpu_cores else ""),
            kv_cache_tokens=capacity, log_tail=supervisor.tail(log),
        )
        if ready:
            self._serve_adapters(replica_id, spec["endpoint"])
        if ready and (engine.kv_policy.host_tier_gib or engine.kv_policy.disk_tier_gib):
            _in_background(self._test_offload, replica_id, engine, address)

    def _certify(self, replica_id: str, engine: supervisor.EngineSpec
                 ) -> tuple[supervisor.EngineSpec, EngineAddress] | None:
        """A key for the replica's engine, made here, and its certificate, signed by the
        control plane: the engine to start, serving HTTPS with them, and how it is reached.
        None when the replica is no longer being started."""
        key_pem, request_pem = tls.new_key_and_request()
        try:
            signed = self.channel.certificate(replica_id, signing_request=request_pem)
        except ChannelRefused as exc:
            raise supervisor.EngineFailed(f"the control plane signed no certificate for the "
                                          f"engine: {exc}") from exc
        if signed is None:
            return None
        key, certificate = tls.write_key_and_certificate(
            Path(engine.cache_dir), key_pem=key_pem, certificate_pem=signed["certificate"])
        return (replace(engine, ssl_keyfile=str(key), ssl_certfile=str(certificate)),
                EngineAddress(host=engine.host, port=engine.port, api_key=engine.api_key,
                              host_name=signed["host_name"], authority_pem=signed["authority"]))

    def sync_adapters(self, replica_id: str) -> None:
        """Make a ready replica's engine serve exactly its endpoint's adapters now: load those
        added (fetching their files first), unload those removed."""
        try:
            spec = self.channel.replica(replica_id)
            if spec is not None and spec["state"] == State.READY and replica_id in self.listening:
                self._serve_adapters(replica_id, spec["endpoint"])
        except Exception:
            self._adapters_seen.pop(replica_id, None)  # the next reading of the work retries
            raise

    def _serve_adapters(self, replica_id: str, endpoint: dict[str, Any]) -> None:
        """An adapter that cannot be fetched or that the engine refuses becomes an event of
        the replica; the others are served. One the engine holds from other files (removed,
        then added again under its name) is loaded anew. The replica's `adapters` say what it
        serves."""
        engine = self.listening.get(replica_id)
        if not endpoint["lora_adapters"] or engine is None:
            return
        where = {"address": engine}
        with self._lock:
            lock = self._adapter_locks.setdefault(replica_id, threading.Lock())
        with lock:  # one change of this engine's adapters at a time; other replicas go on
            try:
                wanted = {f"{endpoint['name']}:{adapter['name']}": adapter
                          for adapter in self.channel.adapters(replica_id)}
                served = supervisor.served_adapters(**where,
                                                    served_model_name=endpoint["name"])
                adapters = self.config.kv_dir(replica_id) / sandbox.ADAPTERS
                visible = {name: adapters / adapter["folder"] for name, adapter in wanted.items()}
                stale = {name for name, folder in served.items()
                         if name not in wanted or folder != str(visible[name])}
                for name in sorted(stale):
                    supervisor.unload_adapter(**where, name=name)
                for name in sorted(wanted.keys() - (served.keys() - stale)):
                    try:
                        folder = sandbox.offer(weights.adapter_dir(
                            wanted[name], replica_id=replica_id, channel=self.channel,
                            config=self.config),
                            visible[name])
                        supervisor.load_adapter(**where, name=name, path=str(folder))
                    except (ChannelDown, NodeRevoked):
                        raise
                    except Exception as exc:  # whatever the cause, only this adapter fails
                        logger.warning("replica %s: adapter %s not served: %s", replica_id,
                                       name, exc)
                        self.channel.note(replica_id, message=(
                            f"adapter {wanted[name]['name']} could not be served: "
                            f"{weights.failure_reason(exc)}"))
                now = supervisor.served_adapters(**where, served_model_name=endpoint["name"])
            except (httpx.HTTPError, supervisor.EngineFailed) as exc:
                # The engine stopped answering: the heartbeat finds out what became of it.
                logger.warning("replica %s: its adapters could not be changed: %s", replica_id,
                               exc)
                self._adapters_seen.pop(replica_id, None)
                return
            self.channel.record_served_adapters(
                replica_id, names=sorted(name.partition(":")[2] for name in now))

    def _download(self, spec: dict[str, Any], log: Path) -> dict[str, Any] | None:
        """Fetch the replica's weights into this node's model cache (starting → downloading),
        showing how far it is as the replica's stage. Returns the model as pinned; None, with
        the replica settled, when it cannot be fetched, and None too when the replica was
        stopped meanwhile (what was fetched is kept for the next start)."""
        replica_id, model = spec["id"], spec["model"]
        if not self.channel.move(
                replica_id, from_states=[State.STARTING], to_state=State.DOWNLOADING,
                message=f"downloading the weights of {model['hf_repo']}"
                + (f" at {model['hf_commit'][:12]}" if model["hf_commit"] else "")):
            return None

        began = time.monotonic()
        heard: list[model_cache.Progress] = []

        def show(progress: model_cache.Progress) -> bool:
            heard[:] = [progress]
            left = progress.seconds_left
            return self.channel.progress(
                replica_id, state=State.DOWNLOADING, stage=progress.describe(),
                percent=progress.percent,
                download_done_at=None if left is None else (
                    datetime.now(UTC) + timedelta(seconds=left)).isoformat())

        try:
            if not model["hf_commit"]:  # a catalog model named by its hub id alone
                model = self.channel.pin(replica_id)
            weights.fetch(model=model, token=self.channel.hub_token(replica_id),
                          channel=self.channel, config=self.config, on_progress=show)
        except model_cache.Cancelled:
            return None
        except (ChannelDown, NodeRevoked):
            raise
        except Exception as exc:  # any cause is a failed start, counted and restarted
            logger.exception("replica %s: downloading its weights failed", replica_id)
            self._record_failure(replica_id, f"the weights could not be downloaded: "
                                 f"{weights.failure_reason(exc)}", log,
                                 from_states=[State.DOWNLOADING])
            return None
        self.channel.note(replica_id, message=heard[-1].describe_done(
            time.monotonic() - began) if heard else "the weights were in this node's cache")
        return model

    def pull_model(self, model_id: int) -> None:
        """Download a model's weights into this node's cache ahead of any replica (an
        operator's pre-pull). A model with local weights, or cached already, needs nothing;
        one that cannot be fetched is logged (an operator's pull: nothing else waits)."""
        pull = self.channel.pull(model_id)
        if pull is None or not weights.needs_download(pull["model"], config=self.config):
            return
        try:
            weights.fetch(model=pull["model"], token=pull["token"], channel=self.channel,
                          config=self.config)
        except Exception as exc:
            logger.warning("pre-pulling %s failed: %s", pull["model"]["hf_repo"],
                           weights.failure_reason(exc))

    def stop_replica(self, replica_id: str) -> None:
        """Stop the replica's engine: SIGTERM, SIGKILL after the grace period; wait for the port.
        The replica is stopped only once no process of its engine is left; until then it stays
        stopping, holding its devices, and the agent tries again when it next reads its work."""
        with self._lock:
            self._stops_asked.add(replica_id)
        spec = self.channel.replica(replica_id)
        if spec is None or spec["state"] != State.STOPPING:
            return
        self._drain(replica_id)
        marker = self.config.owner(self.name)
        with self._lock:
            process = self.engines.pop(replica_id, None)
            groups = processes.running_engines(marker).get(replica_id, set())
        children = [process] if process is not None else []
        self._stop_and_reap(groups | {child.pid for child in children}, children,
                            grace=self.timings.stop_grace_seconds)
        if replica_id in processes.running_engines(marker):
            logger.warning("replica %s: its engine outlived SIGKILL; the stop will come again",
                           replica_id)
            return
        deadline = time.monotonic() + 10
        while (spec["port"] and not processes.port_is_free(spec["port"], self.address)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        self.listening.pop(replica_id, None)
        shutil.rmtree(self.config.kv_dir(replica_id), ignore_errors=True)
        self.channel.move(replica_id, from_states=[State.STOPPING], to_state=State.STOPPED,
                          message="engine stopped, port freed",
                          log_tail=supervisor.tail(self.config.log_path(replica_id)))

    def beat(self) -> bool:
        """One heartbeat of the node `name`: report the engines it runs and stop, in the
        background, those kvrun no longer expects; publish each engine's last log lines (the API
        shows them while it loads); fail a ready engine that exited once its group is gone (the
        reconciler restarts it after a backoff). Returns False when the node must register again.
        Nothing here waits for an engine to stop."""
        with self._lock:
            running = processes.running_engines(self.config.owner(self.name))
            unexpected = self.channel.heartbeat(engines=running)
            if unexpected is None:
                return False
            children = {rid: self.engines.pop(rid) for rid in unexpected
                        if rid in self.engines and self.engines[rid].pid in running.get(rid, ())}
        for rid in unexpected & running.keys():
            logger.warning("replica %s: kvrun no longer expects its engine here; stopping it", rid)
            _in_background(self._stop_unexpected, rid, running[rid],
                           [children[rid]] if rid in children else [])
        with self._lock:
            exited = {rid: p for rid, p in self.engines.items() if p.poll() is not None}
            for rid in exited:
                self.engines.pop(rid)
            live = list(self.engines)
        for rid in live:
            self.channel.record_log(rid, log_tail=supervisor.tail(self.config.log_path(rid)))
        for rid, process in exited.items():
            _in_background(self._fail_once_stopped, rid, process)
        if time.monotonic() >= self._next_log_sweep:
            self._next_log_sweep = time.monotonic() + LOG_SWEEP_SECONDS
            here = self.channel.replicas()
            delete_old_logs(self.config, kept={replica["id"] for replica in here})
            delete_unused_compile_caches(self.config,
                                         kept={replica["organization"] for replica in here})
        return True

    def scrape(self) -> int:
        """Read the /metrics of each of this agent's engines and send them to the control
        plane, the engines at once, so that a slow one delays no other's sample; an engine
        whose answer is late or too large (_read_one) is left out this time. Returns how many
        samples the control plane kept."""
        listening = list(self.listening.items())
        read = asyncio.run(_read_all(listening))
        return self.channel.record_samples(samples=[
            {"replica": rid, "at": at.isoformat(), **asdict(snapshot)}
            for (rid, _), (snapshot, at) in zip(listening, read, strict=True)
            if snapshot is not None])

    def engine_spec(self, spec: dict[str, Any], port: int) -> supervisor.EngineSpec:
        """How to start the engine of the replica `spec` (fleet.selectors.replica_spec)."""
        endpoint, model = spec["endpoint"], spec["model"]
        device = CPU if endpoint["device"] == CPU else GPU
        compile_cache = self.config.compile_cache_dir(endpoint["organization"])
        compile_cache.mkdir(parents=True, exist_ok=True)
        os.utime(compile_cache)  # used now: kept COMPILE_CACHE_KEPT_DAYS from here
        return supervisor.EngineSpec(
            model_dir=str(weights.weights_dir(model, config=self.config)),
            trust_remote_code=model["trust_remote_code"],
            # A control plane from before tasks sends none: its models all generate.
            task=model.get("task", tasks.GENERATE), architecture=model.get("architecture", ""),
            tool_call_parser=model["tool_call_parser"],
            reasoning_parser=model["reasoning_parser"],
            served_model_name=endpoint["name"],
            host=self.address,
            port=port,
            max_model_len=endpoint["context_length"],
            max_num_seqs=endpoint["concurrency"],
            device=device,
            tensor_parallel=endpoint["gpu_count"],
            kv_policy=KVPolicy(kv_cache_dtype=endpoint["kv_cache_dtype"],
                               prefix_caching=endpoint["prefix_caching"],
                               host_tier_gib=endpoint["host_tier_gib"],
                               disk_tier_gib=endpoint["disk_tier_gib"]),
            cache_dir=str(self.config.kv_dir(spec["id"])),
            compile_cache=str(compile_cache),
            vllm_version=kv_policy.installed_version(device),
            cpu_kv_cache_bytes=endpoint["cpu_kv_cache_bytes"],
            device_indices=tuple(spec["device_indices"]),
            api_key=spec["engine_key"],
            owner=self.config.owner(self.name),
            replica=spec["id"],
            lora_adapters=endpoint["lora_adapters"],
            lora_max_rank=endpoint["lora_max_rank"],
            lora_host_adapters=endpoint["lora_host_adapters"],
        )

    def fail_replicas_of_previous_run(self) -> int:
        """On agent start: the engines of the agent's previous life are gone (it stopped those
        left behind first); their replicas fail, and are restarted."""
        return sum(self._record_failure(
            replica["id"], "the node agent restarted and its engines with it",
            self.config.log_path(replica["id"]), from_states=AT_WORK)
            for replica in self.channel.replicas() if replica["state"] in AT_WORK)

    def delete_kv_caches_left_behind(self) -> None:
        """On agent start, once no engine of its previous run is left: delete the KV caches
        on disk of the node's replicas, since none of them runs now."""
        for replica in self.channel.replicas():
            shutil.rmtree(self.config.kv_dir(replica["id"]), ignore_errors=True)

    def stop_all_engines(self) -> None:
        """On agent shutdown: stop every engine, whatever it is doing (a start waiting on one then
        ends), within the time the agent's own supervisor gives the agent."""
        self._shutting_down.set()  # before the lock, which a start or a beat may hold
        with self._lock:
            children = list(self.engines.values())
            groups = set().union(*processes.running_engines(self.config.owner(self.name)).values())
        # Every group, those a background stop is on included: the agent may exit before it ends.
        processes.stop_groups(groups | {child.pid for child in children},
                              grace=min(SHUTDOWN_GRACE_SECONDS,
                                        self.timings.stop_grace_seconds))
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
            sorted(ranked[:self.config.cpu_cores_per_engine]))
        return self.cpu_cores[replica_id]

    def _forget_and_stop(self, replica_id: str, process: Popen) -> None:
        with self._lock:
            self.engines.pop(replica_id, None)
        self._stop_and_reap({process.pid}, [process], self.timings.stop_grace_seconds)

    def _fail_once_stopped(self, replica_id: str, process: Popen) -> None:
        # The API server is gone; its engine-core children may not be: end the whole group
        # before the failure frees the replica's devices.
        self._stop_and_reap({process.pid}, [process], self.timings.stop_grace_seconds)
        self._record_failure(replica_id, f"the engine exited with status {process.returncode}",
                             self.config.log_path(replica_id), from_states=[State.READY])

    def _record_failure(self, replica_id: str, reason: str, log: Path, *,
                        from_states: Collection[str]) -> bool:
        shutil.rmtree(self.config.kv_dir(replica_id), ignore_errors=True)  # its engine is gone
        self.listening.pop(replica_id, None)
        logger.warning("replica %s failed: %s", replica_id, reason)
        return self.channel.fail(replica_id, from_states=from_states, reason=reason,
                                 log_tail=supervisor.tail(log))

    def _drain(self, replica_id: str) -> None:
        """Let a stopping replica's engine finish its work before it stops: first until every
        gateway has dropped it (they route to ready replicas only, and hold their routes for
        KVRUN_GATEWAY_ROUTE_CACHE_SECONDS), then until its requests in flight have finished,
        at most KVRUN_ENGINE_DRAIN_SECONDS in all. An engine that does not answer is not
        waited for. Without this, a rolling change or a scale-down cuts requests off
        mid-answer."""
        engine = self.listening.get(replica_id)
        if engine is None:
            return
        deadline = time.monotonic() + self.timings.drain_seconds
        time.sleep(min(self.timings.route_cache_seconds + ROUTE_MARGIN_SECONDS,
                       self.timings.drain_seconds))
        while time.monotonic() < deadline:
            busy = asyncio.run(_read_all([(replica_id, engine)]))[0][0]
            if busy is None or busy.running + busy.waiting == 0:
                return
            time.sleep(0.5)

    def _test_offload(self, replica_id: str, spec: supervisor.EngineSpec,
                      address: EngineAddress) -> None:
        """The offload self-test on a replica just ready with a KV tier; its verdict becomes
        the replica's event."""
        try:
            verdict = offload_check.run(
                address=address, model=spec.served_model_name,
                disk_tier=bool(spec.kv_policy.disk_tier_gib),
                prefix_caching=spec.kv_policy.prefix_caching,
                context_length=spec.max_model_len)
            message = verdict.message
        except httpx.HTTPError as exc:
            message = f"KV tier self-test could not run: {exc}"
        self.channel.note(replica_id, message=message)

    def _stop_unexpected(self, replica_id: str, groups: set[int], children: list[Popen]) -> None:
        self._stop_and_reap(groups, children, self.timings.stop_grace_seconds)
        shutil.rmtree(self.config.kv_dir(replica_id), ignore_errors=True)
        self.listening.pop(replica_id, None)

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


def delete_unused_compile_caches(config: AgentConfig, *, kept: Collection[str]) -> int:
    """Delete the compile caches of organisations with no replica here (`kept` names those
    with one) whose last engine here started COMPILE_CACHE_KEPT_DAYS ago; returns how many."""
    root = config.compile_cache_root
    cutoff = time.time() - COMPILE_CACHE_KEPT_DAYS * 86400
    gone = [path for path in (root.iterdir() if root.is_dir() else ())
            if _is_uuid(path.name) and path.name not in kept and path.stat().st_mtime < cutoff]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return len(gone)


def delete_old_logs(config: AgentConfig, *, kept: Collection[str]) -> int:
    """Delete the engine logs last written KVRUN_ENGINE_LOG_KEPT_DAYS ago or more, but those
    of the replicas in `kept` (those the node holds devices for): every wake from zero and
    every scale-up leaves one. The control plane keeps each replica's last lines. Returns how
    many it deleted."""
    cutoff = time.time() - config.engine_log_kept_days * 86400
    old: list[Path] = []
    try:
        with os.scandir(config.engine_log_dir) as entries:
            for entry in entries:
                stem = entry.name.removesuffix(".log")
                if (entry.name.endswith(".log") and _is_uuid(stem) and stem not in kept
                        and entry.stat().st_mtime < cutoff):
                    old.append(Path(entry.path))
    except FileNotFoundError:  # no engine has started here yet, or a log just went
        return 0
    for log in old:
        log.unlink(missing_ok=True)
    return len(old)


async def _read_all(engines: list[tuple[str, EngineAddress]]
                    ) -> list[tuple[metrics.EngineSnapshot | None, datetime]]:
    """Each engine's /metrics (None where _read_one gives none) and when it was read, at
    most SCRAPE_MOST_ENGINES_AT_ONCE at a time."""
    at_once = asyncio.Semaphore(SCRAPE_MOST_ENGINES_AT_ONCE)

    async def read(replica_id: str, engine: EngineAddress
                   ) -> tuple[metrics.EngineSnapshot | None, datetime]:
        async with at_once:
            try:
                async with engine.async_client(timeout=SCRAPE_TIMEOUT_SECONDS) as client:
                    snapshot = await _read_one(client, replica_id)
            except Exception:  # one engine's answer never costs the others their samples
                logger.exception("the /metrics of replica %s could not be read", replica_id)
                snapshot = None
        return snapshot, datetime.now(UTC)
    return await asyncio.gather(*(read(*engine) for engine in engines))


async def _read_one(client: httpx.AsyncClient, replica_id: str
                    ) -> metrics.EngineSnapshot | None:
    """The engine's /metrics now. None when it does not answer, or not as Prometheus text,
    or when its whole answer, headers included, takes more than SCRAPE_TIMEOUT_SECONDS, is
    larger than SCRAPE_MOST_BYTES, or comes compressed (a small body can unpack to any
    size)."""
    body = bytearray()
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT_SECONDS), client.stream(
                "GET", "/metrics", headers={"Accept-Encoding": "identity"}) as response:
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


def _dropped(replica_id: str, why: str) -> None:
    logger.warning("the /metrics of replica %s was dropped: %s", replica_id, why)
    return None


def stop_engines_left_behind(config: AgentConfig, *, name: str, grace: float) -> int:
    """On agent start: stop every engine the agent's previous run left (a loading engine
    outlives a killed agent), found by their marker. Returns how many replicas they
    served."""
    left = processes.running_engines(config.owner(name))
    processes.stop_groups(set().union(*left.values()), grace=grace)
    return len(left)


def _is_uuid(text: str) -> bool:
    try:
        UUID(text)
    except ValueError:
        return False
    return True


def _in_background(target: Callable[..., None], *args: object, **kwargs: object) -> None:
    threading.Thread(target=_logged, args=(target, *args), kwargs=kwargs, daemon=True).start()


def _logged(target: Callable[..., None], *args: object, **kwargs: object) -> None:
    try:
        target(*args, **kwargs)
    except Exception:  # a stop: the next heartbeat finds what is left and tries again
        logger.exception("the agent's background work failed")
