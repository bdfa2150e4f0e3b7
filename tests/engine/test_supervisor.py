import time
from pathlib import Path

import pytest

from engine.kv_policy import KVPolicy
from engine.processes import free_port
from engine.supervisor import (
    EngineFailed,
    EngineSpec,
    build_command,
    engine_environment,
    read_kv_capacity,
    tail,
    wait_ready,
)
from engine.tls import EngineAddress
from gateway.proxy import POOLED_IDLE_SECONDS


def spec(**overrides: object) -> EngineSpec:
    values = dict(model_dir="/models/demo", served_model_name="chat", port=41000,
                  max_model_len=4096, max_num_seqs=8, api_key="engine-secret")
    values.update(overrides)
    return EngineSpec(**values)


def test_a_gpu_command_pins_devices_and_memory() -> None:
    argv, env = build_command(spec(device="gpu", tensor_parallel=2, device_indices=(2, 3),
                                   kv_policy=KVPolicy(kv_cache_dtype="fp8")), python="python")

    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for part in ["--model /models/demo", "--served-model-name chat", "--host 127.0.0.1",
                 "--port 41000", "-tp 2", "--max-model-len 4096", "--max-num-seqs 8",
                 "--kv-cache-dtype fp8", "--enable-prefix-caching",
                 "--gpu-memory-utilization 0.90"]:
        assert part in joined
    assert "--enforce-eager" not in argv
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_API_KEY"] == "engine-secret"
    assert "engine-secret" not in joined  # never in argv, where `ps` shows it


def test_a_cpu_command_sets_the_kv_space_and_eager_mode() -> None:
    argv, env = build_command(spec(device="cpu", cpu_kv_cache_bytes=4_194_304,
                                   kv_policy=KVPolicy(prefix_caching=False)))

    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    assert "--gpu-memory-utilization" not in argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "4194304"
    # vLLM's whole-GiB setting would override the exact budget: never passed on.
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_environment(
        {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "INFO"}, env)
    assert engine_environment({"VLLM_LOGGING_LEVEL": "INFO"}, env)["VLLM_LOGGING_LEVEL"] == "INFO"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # vLLM binds it by itself


def test_a_cpu_engine_given_cores_binds_its_threads_to_them() -> None:
    _, env = build_command(spec(device="cpu", cpu_cores=(2, 3)))

    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"


def test_only_a_model_an_operator_allowed_runs_its_repository_s_code() -> None:
    assert "--trust-remote-code" not in build_command(spec())[0]
    assert "--trust-remote-code" in build_command(spec(trust_remote_code=True))[0]


def test_it_reads_the_kv_capacity_vllm_logs() -> None:
    line = ("(EngineCore pid=4798) INFO 12-02 14:04:07 [kv_cache_utils.py:2327] CPU KV cache size: "
            "2,097,152 tokens, Maximum concurrency for 2,048 tokens per request: 1024.00x")

    assert read_kv_capacity("noise\n" + line + "\n") == 2_097_152
    assert read_kv_capacity("no capacity here") is None
    # A restart appends to the replica's log: its engine now is the last one.
    assert read_kv_capacity(line + "\nrestarted\n" + line.replace("2,097,152", "1,024")) == 1024


def test_tail_returns_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("\n".join(f"line {n}" for n in range(100)))

    assert tail(log, lines=3) == "line 97\nline 98\nline 99"
    assert tail(tmp_path / "missing.log") == ""


def test_an_engine_listens_on_its_node_s_address_and_reports_cached_tokens() -> None:
    argv, _ = build_command(spec(host="10.0.0.7"))

    joined = " ".join(argv)
    assert "--host 10.0.0.7" in joined
    assert "--enable-prompt-tokens-details" in argv  # usage then carries cached_tokens
    assert "--disable-access-log-for-endpoints /health,/metrics" in joined


def test_an_engine_inherits_nothing_of_the_control_plane() -> None:
    control_plane = {"PATH": "/usr/bin", "HOME": "/root", "HF_HUB_OFFLINE": "1",
                     "CUDA_HOME": "/usr/local/cuda", "SECRET_KEY": "s", "KVRUN_KEY_PEPPER": "p",
                     "DATABASE_URL": "postgres://kvrun:pw@db/kvrun", "REDIS_URL": "redis://r",
                     "STRIPE_API_KEY": "sk", "VLLM_API_KEY": "the control plane's own",
                     "HF_TOKEN": "hf_operator", "XDG_CACHE_HOME": "/root/.cache",
                     "TMPDIR": "/var/tmp"}

    env = engine_environment(control_plane, {"VLLM_API_KEY": "engine-secret"})

    # HOME is the sandbox's (the replica's own directory); the host's paths are not there.
    assert env == {"PATH": "/usr/bin", "HF_HUB_OFFLINE": "1", "CUDA_HOME": "/usr/local/cuda",
                   "VLLM_API_KEY": "engine-secret"}


def test_an_engine_with_a_key_demands_it_on_every_path() -> None:
    argv, _ = build_command(spec(device="cpu"))

    assert argv[argv.index("--middleware") + 1] == "engine.key_guard.RequireEngineKey"


def test_an_engine_serves_tls_with_its_replica_s_key_and_certificate() -> None:
    argv, _ = build_command(spec(ssl_keyfile="/r/engine-tls.key",
                                 ssl_certfile="/r/engine-tls.crt"))

    assert argv[argv.index("--ssl-keyfile") + 1] == "/r/engine-tls.key"
    assert argv[argv.index("--ssl-certfile") + 1] == "/r/engine-tls.crt"
    assert "--ssl-keyfile" not in build_command(spec())[0]


def test_an_engine_not_ready_within_the_start_timeout_has_failed() -> None:
    started = time.monotonic()

    with pytest.raises(EngineFailed, match="not ready within 1 s"):
        wait_ready(address=EngineAddress(host="127.0.0.1", port=free_port(), api_key="k"),
                   served_model_name="chat", alive=lambda: True, timeout=1.0)

    assert 1.0 <= time.monotonic() - started < 5


def test_an_engine_that_exits_while_starting_has_failed_at_once() -> None:
    started = time.monotonic()

    with pytest.raises(EngineFailed, match="exited during start-up"):
        wait_ready(address=EngineAddress(host="127.0.0.1", port=free_port(), api_key="k"),
                   served_model_name="chat", alive=lambda: False, timeout=60)

    assert time.monotonic() - started < 1


def test_an_engine_keeps_idle_connections_longer_than_the_gateway_pools_them() -> None:
    # Else the engine closes a connection the gateway is about to send a request on.
    _, env = build_command(spec())

    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > POOLED_IDLE_SECONDS


def test_an_engine_takes_tools_and_reasoning_only_with_its_model_s_parsers() -> None:
    argv, _ = build_command(spec(tool_call_parser="hermes", reasoning_parser="qwen3"))

    # Without --enable-auto-tool-choice vLLM loads no parser at all.
    assert argv[argv.index("--tool-call-parser") - 1] == "--enable-auto-tool-choice"
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    bare, _ = build_command(spec())
    assert not {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} & set(
        bare)


def test_a_pooling_engine_reads_a_batch_of_its_longest_inputs_at_once() -> None:
    argv, _ = build_command(spec(task="embed", architecture="Qwen3ForCausalLM",
                                 max_model_len=512, max_num_seqs=32))

    joined = " ".join(argv)
    assert "--runner pooling --convert embed" in joined
    assert "--max-num-batched-tokens 16384" in joined
    assert "--runner" not in build_command(spec())[0]
