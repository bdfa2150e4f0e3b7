"""Build, start and watch one vLLM engine process. Pure Python, no Django.

An engine runs in a process group of its own (engine.processes, which also stops it), in its
sandbox (engine.sandbox), bound to its node's address (127.0.0.1 by default), serving HTTPS
with its replica's certificate (engine.tls) and taking its key on every path but /health,
with a per-replica log file from which kvrun reads the KV capacity and
shows the last lines when it fails.
"""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine import sandbox, tasks
from engine.kv_policy import EngineKV, KVPolicy, build_for, engine_kv, lmcache_yaml
from engine.processes import engine_group_dying_with_parent, engine_session_yields
from engine.sizing import CPU, GIB, GPU
from engine.tls import EngineAddress

KV_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True)
class EngineSpec:
    """Everything the command needs; built by the control plane from the endpoint."""

    model_dir: str
    served_model_name: str
    port: int
    max_model_len: int
    max_num_seqs: int
    host: str = "127.0.0.1"
    device: str = GPU  # or CPU
    tensor_parallel: int = 1
    kv_policy: KVPolicy = field(default_factory=KVPolicy)
    # The replica's own directory for its KV tiers on disk and their config; its owner
    # deletes it when the replica stops.
    cache_dir: str = ""
    # Kept from one start to the next (compiled kernels, inspected model classes), shared by
    # one organisation's engines only: a tenant's engine could plant code in it.
    compile_cache: str = ""
    vllm_version: str | None = None  # the installed build's; None: the pinned one
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_bytes: int = GIB  # a CPU engine's KV pool: what its policy budgets
    device_indices: tuple[int, ...] = ()
    cpu_cores: tuple[int, ...] = ()  # a CPU engine's OpenMP threads, bound; (): vLLM's choice
    api_key: str = ""
    # Its TLS key and certificate (engine.tls), in the replica's own directory; "": plain HTTP.
    ssl_keyfile: str = ""
    ssl_certfile: str = ""
    owner: str = ""  # engine.processes.owner_of(the node, the state directory)
    replica: str = ""
    trust_remote_code: bool = False  # an operator allowed the model's own code to run
    # engine.tasks: to generate, or to pool (embeddings, scores) with the checkpoint's
    # architecture saying whether the engine converts it.
    task: str = tasks.GENERATE
    architecture: str = ""
    tool_call_parser: str = ""  # engine.parsers; "": the engine takes no tools
    reasoning_parser: str = ""
    # LoRA adapters held on the device at once (0: the engine serves none), their largest
    # rank, and how many it keeps in host memory (0: as many as on the device).
    lora_adapters: int = 0
    lora_max_rank: int = 16
    lora_host_adapters: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()  # flags beyond what a policy sets (gpu-check's loader)


def build_command(spec: EngineSpec,
                  python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions that start `spec`'s engine."""
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model_dir,
        "--served-model-name", spec.served_model_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "-tp", str(spec.tensor_parallel),
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        # Usage then reports cached prompt tokens, which the gateway meters.
        "--enable-prompt-tokens-details",
        # The node agent's probes and scrapes, every few seconds, would fill the log (and the
        # tail of it the dashboard shows) with access lines.
        "--disable-access-log-for-endpoints", "/health,/metrics",
    ]
    kv = _engine_kv(spec)
    argv += kv.argv + list(spec.extra_args)
    argv += tasks.runner_args(spec.task, architecture=spec.architecture)
    if spec.task in tasks.POOLING:
        # A batch holds as many of the longest inputs as the endpoint asked for: a pooling
        # model reads each input whole, in one step.
        argv += ["--max-num-batched-tokens", str(spec.max_model_len * spec.max_num_seqs)]
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    if spec.tool_call_parser:
        # Without the first flag vLLM loads no parser, and takes no tool choice but "none".
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    if spec.reasoning_parser:
        argv += ["--reasoning-parser", spec.reasoning_parser]
    if spec.lora_adapters:
        argv += ["--enable-lora", "--max-loras", str(spec.lora_adapters),
                 "--max-lora-rank", str(spec.lora_max_rank),
                 "--max-cpu-loras", str(max(spec.lora_adapters, spec.lora_host_adapters))]
    if spec.ssl_keyfile:
        argv += ["--ssl-keyfile", spec.ssl_keyfile, "--ssl-certfile", spec.ssl_certfile]
    if spec.api_key:
        # vLLM checks the key under /v1 only; this checks it on every other path but /health.
        argv += ["--middleware", "engine.key_guard.RequireEngineKey"]
    # The key goes in the environment: an argv is readable by every user through `ps`.
    env = {"HF_HUB_OFFLINE": "1", "VLLM_API_KEY": spec.api_key,
           "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_SECONDS),
           **kv.env, **spec.extra_env}
    if spec.lora_adapters:
        # Adapters added while the endpoint runs reach its engines without a restart.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if spec.device == CPU:
        argv += ["--enforce-eager",  # no CUDA graphs on the CPU backend
                 "--kv-cache-memory-bytes", str(spec.cpu_kv_cache_bytes)]
        if spec.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(core) for core in spec.cpu_cores)
    else:
        argv += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:.2f}"]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in spec.device_indices)
    return argv, env


# How long an engine keeps an idle client connection open: vLLM's own default, set so that an
# inherited value cannot undercut the gateway's pool, which drops idle connections sooner
# (gateway.proxy): the client always closes first, or a request sent on a connection just as
# the engine closed it would fail (a 502). Not longer: measured with 75 s, a client that left
# before its answer no longer stopped the engine's generation.
KEEP_ALIVE_SECONDS = 5


def _engine_kv(spec: EngineSpec) -> EngineKV:
    return engine_kv(spec.kv_policy, build=build_for(spec.device, spec.vllm_version),
                     cache_dir=Path(spec.cache_dir))


# What an engine sees of the environment it is started from: what the system, Python,
# PyTorch and vLLM need, and nothing of the control plane's (its secret key, the pepper, the
# database and Redis URLs): an engine's /proc/<pid>/environ is readable by its own user.
INHERITED_NAMES = frozenset({"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH",
                             "LD_PRELOAD", "VIRTUAL_ENV"})
INHERITED_PREFIXES = ("VLLM_", "HF_", "CUDA_", "NVIDIA_", "TORCH", "OMP_", "MKL_", "KMP_",
                      "NCCL_", "TRITON_", "TRANSFORMERS_")
# What kvrun sets by flag, which vLLM would let an inherited value override (the CPU
# engine's KV pool in whole GiB would win over its exact budget), and the operator's hub
# tokens, which are not an engine's to hold. The sandbox sets HOME, USER, LOGNAME and
# PYTHONPATH; paths of the host (caches, TMPDIR) are not inherited: the engine has none of
# them.
NEVER_INHERITED = frozenset({"VLLM_CPU_KVCACHE_SPACE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                             "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN_PATH"})


def engine_environment(inherited: Mapping[str, str], additions: Mapping[str, str]
                       ) -> dict[str, str]:
    """The whole environment of an engine: the allowed part of `inherited`, then `additions`."""
    kept = {name: value for name, value in inherited.items()
            if (name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES))
            and name not in NEVER_INHERITED}
    return {**kept, **additions}


def start(spec: EngineSpec, log_path: Path) -> subprocess.Popen:
    """Start `spec`'s engine (launch)."""
    argv, env = build_command(spec)
    return launch(argv, env, spec=spec, log_path=log_path)


def launch(argv: list[str], env: Mapping[str, str], *, spec: EngineSpec,
           log_path: Path) -> subprocess.Popen:
    """Run `argv` as `spec`'s engine is run: in its sandbox (engine.sandbox) and a process
    group of its own, below its node's own processes for the CPU
    (engine.processes.ENGINE_NICENESS), its environment `env` and what it may inherit,
    output appended to `log_path`, which only the agent's user reads."""
    if spec.cache_dir:
        (Path(spec.cache_dir) / sandbox.ADAPTERS).mkdir(parents=True, exist_ok=True)
    if spec.compile_cache:
        Path(spec.compile_cache).mkdir(parents=True, exist_ok=True)
    lmcache_config = _engine_kv(spec).lmcache_config
    if lmcache_config is not None:
        if not spec.cache_dir:
            raise ValueError("a disk tier needs the replica's own directory (cache_dir)")
        Path(env["LMCACHE_CONFIG_FILE"]).write_text(lmcache_yaml(lmcache_config))
    argv = sandbox.command(argv, owner=spec.owner, replica=spec.replica,
                           model_dir=spec.model_dir, replica_dir=spec.cache_dir,
                           compile_cache=spec.compile_cache,
                           devices=spec.device_indices if spec.device == GPU else ())
    log_path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(descriptor, 0o600)  # a log kept from an earlier start, or an earlier kvrun
    with open(descriptor, "ab") as log:
        process = subprocess.Popen(argv, env=engine_environment(os.environ, env), stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   preexec_fn=engine_group_dying_with_parent)
    engine_session_yields(process.pid)
    return process


class EngineFailed(Exception):
    """The engine exited or never became ready; the message carries its last log lines."""


def wait_ready(*, address: EngineAddress, served_model_name: str,
               alive: Callable[[], bool], timeout: float, task: str = tasks.GENERATE,
               on_progress: Callable[[str], None] = lambda stage: None) -> None:
    """Return once /health answers, /v1/models lists the model and a warm-up request of
    its `task` has been served; raise EngineFailed if the process dies or the timeout passes
    first."""
    deadline = time.monotonic() + timeout
    healthy = False
    with address.client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise EngineFailed("the engine exited during start-up")
            try:
                if not healthy:
                    healthy = client.get("/health").status_code == 200
                    if healthy:
                        on_progress("health")
                if healthy:
                    models = client.get("/v1/models")
                    if models.status_code == 200 and any(
                        item["id"] == served_model_name for item in models.json()["data"]
                    ):
                        warm_up(client, served_model_name, task=task)
                        return
            except httpx.ConnectError as exc:
                # Not yet listening, or listening with a certificate it may not serve with
                # (then waiting longer changes nothing).
                refused = _certificate_refused(exc)
                if refused is not None:
                    raise EngineFailed(f"the engine's certificate was refused: "
                                       f"{refused.verify_message}") from exc
            except httpx.TransportError:
                pass
            time.sleep(0.25)
    raise EngineFailed(f"the engine was not ready within {timeout:.0f} s")


def _certificate_refused(error: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate check that failed under `error`, if one did (httpx wraps it twice)."""
    while error is not None and not isinstance(error, ssl.SSLCertVerificationError):
        error = error.__context__  # type: ignore[assignment]
    return error


WARM_UP_PROMPT = "kvrun checks that the engine answers before it takes traffic."


# What a warm-up asks of an engine of each task (engine.tasks): its path and its body.
WARM_UPS: dict[str, tuple[str, dict[str, object]]] = {
    tasks.GENERATE: ("/v1/completions", {"prompt": WARM_UP_PROMPT, "max_tokens": 1}),
    tasks.EMBED: ("/v1/embeddings", {"input": WARM_UP_PROMPT}),
    tasks.SCORE: ("/v1/score", {"text_1": WARM_UP_PROMPT, "text_2": WARM_UP_PROMPT}),
}


def warm_up(client: httpx.Client, served_model_name: str, *, task: str) -> None:
    """One short request of `task` before any user request, by `client`
    (EngineAddress.client). On vLLM's CPU build a one-token prompt as an engine's very first
    request kills its worker (SIGILL); after any longer first request it is served normally.
    On a GPU it moves first-request compilation off users."""
    path, body = WARM_UPS[task]
    response = client.post(path, timeout=60.0, json={"model": served_model_name, **body})
    if response.status_code != 200:
        raise EngineFailed(f"the engine failed its first request ({response.status_code}): "
                           f"{response.text[:300]}")


def load_adapter(*, address: EngineAddress, name: str, path: str) -> None:
    """Load the LoRA adapter in folder `path` into a running engine under `name`; one it
    already holds by that name is left as it is. Raises EngineFailed with the engine's
    reason when it refuses the adapter."""
    with address.client(timeout=120.0) as client:
        response = client.post("/v1/load_lora_adapter",
                               json={"lora_name": name, "lora_path": path})
    if response.status_code != 200 and "already been loaded" not in response.text:
        raise EngineFailed(f"the engine refused the adapter {name} "
                           f"({response.status_code}): {response.text[:300]}")


def unload_adapter(*, address: EngineAddress, name: str) -> None:
    """Unload the LoRA adapter `name` from a running engine; one it does not hold is gone
    already."""
    with address.client(timeout=30.0) as client:
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    if response.status_code not in (200, 404):
        raise EngineFailed(f"the engine did not unload the adapter {name} "
                           f"({response.status_code}): {response.text[:300]}")


def served_adapters(*, address: EngineAddress, served_model_name: str) -> dict[str, str]:
    """The LoRA adapters a running engine serves now: each one's name, and the folder it
    was loaded from."""
    with address.client(timeout=10.0) as client:
        response = client.get("/v1/models")
    response.raise_for_status()
    return {item["id"]: str(item.get("root") or "") for item in response.json()["data"]
            if item["id"] != served_model_name}


def read_kv_capacity(log_text: str) -> int | None:
    """The `KV cache size: N tokens` figure vLLM logs once the cache is allocated: the last
    one, since a replica's log keeps its earlier engines' lives (a restart appends)."""
    found = KV_CAPACITY.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def tail(log_path: Path, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(log_path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - max_bytes))
            text = handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


