"""`make gpu-check`: kvrun's GPU sizing against what a CUDA vLLM logs, on a host with an NVIDIA
GPU and no internet, in a few minutes.

For real models' shapes (Llama 3.1 8B's and Qwen 2.5 7B's published configs; weights made
on the GPU by vLLM's dummy loader; the demo model's 512-token vocabulary, so that every token
a random model emits decodes, with the parameter count lowered to match), each engine is
started with
the command kvrun's own builder makes (engine.supervisor.build_command), and kvrun's
predicted KV capacity (engine.sizing: gpu_memory_utilization headroom, RUNTIME_OVERHEAD_BYTES
per GPU, 16-token blocks) is compared with the `KV cache size` the engine logs (goal: within
1 %). The engine's own figures for its weights and its KV memory are printed beside, so a
miss says which term is off. One more start with a host-memory tier (engine.kv_policy)
runs the offload self-test (engine.offload_check) that every tiered replica gets. Start times are
reported. Prints a table and writes bench/results/gpu_check.json.

    python -m bench.gpu_check
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from engine import demo_model, devices, offload_check, processes, supervisor
from engine.kv_policy import KVPolicy
from engine.sizing import GPU, Accelerator, ModelShape, Request, evaluate, kv_cache_tokens
from engine.tls import EngineAddress

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CONTEXT, CONCURRENCY = 8192, 8
START_TIMEOUT = 300
GOAL_ERROR_PCT = 1.0
# Published configs (config.json on the Hub), the fields vLLM reads for these shapes.
SHAPES = {
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "vocab_size": 128256, "max_position_embeddings": 131072,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "parameters": 8030261248},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
                   "vocab_size": 152064, "max_position_embeddings": 32768,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "parameters": 7615616512},
}
LOADED = re.compile(r"Model loading took ([\d.]+) GiB")
AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


def parameters(name: str) -> int:
    """The shape's parameters with the demo vocabulary in place of its own (embeddings and
    output head untied, as in both models)."""
    config = SHAPES[name]
    return config["parameters"] - 2 * (config["vocab_size"] - demo_model.VOCAB_SIZE) * config[
        "hidden_size"]


def model_dir(name: str, base: Path) -> Path:
    """A folder vLLM serves with `--load-format dummy`: the shape's config and a tokenizer."""
    folder = base / name
    tokenizer = demo_model.build(base / "tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    for file in tokenizer.glob("*token*"):
        shutil.copy(file, folder / file.name)
    config = {key: value for key, value in SHAPES[name].items() if key != "parameters"}
    config["vocab_size"] = demo_model.VOCAB_SIZE
    (folder / "config.json").write_text(json.dumps(
        {**config, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 0,
         "eos_token_id": 1, "hidden_act": "silu"}))
    return folder


def shape_of(name: str) -> ModelShape:
    config = SHAPES[name]
    return ModelShape(name=name, parameters=parameters(name),
                      layers=config["num_hidden_layers"],
                      attention_heads=config["num_attention_heads"],
                      kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                      max_context=config["max_position_embeddings"])


def address_of(spec: supervisor.EngineSpec) -> EngineAddress:
    """Where a bare engine of this check listens (plain HTTP, on loopback)."""
    return EngineAddress(host=spec.host, port=spec.port, api_key=spec.api_key)


def start(name: str, folder: Path, device: devices.Device, log: Path,
          policy: KVPolicy) -> tuple[object, supervisor.EngineSpec, float]:
    spec = supervisor.EngineSpec(
        model_dir=str(folder), served_model_name=name, port=processes.free_port(),
        max_model_len=CONTEXT, max_num_seqs=CONCURRENCY, device=GPU,
        device_indices=(device.index,), api_key="gpu-check", kv_policy=policy,
        cache_dir=str(log.parent / f"{name}-cache"), extra_args=("--load-format", "dummy"))
    started = time.monotonic()
    process = supervisor.start(spec, log)
    try:
        supervisor.wait_ready(address=address_of(spec), served_model_name=name,
                              alive=lambda: process.poll() is None, timeout=START_TIMEOUT)
    except supervisor.EngineFailed:
        processes.stop_group(process.pid, grace=10)
        raise
    return process, spec, time.monotonic() - started


def capacity_row(name: str, base: Path, device: devices.Device) -> dict:
    folder = model_dir(name, base)
    log = base / f"{name}.log"
    process, _, seconds = start(name, folder, device, log, KVPolicy())
    processes.stop_group(process.pid, grace=15)
    text = log.read_text(errors="replace")
    logged = supervisor.read_kv_capacity(text)
    shape = shape_of(name)
    accelerator = Accelerator(slug="gpu", name=device.name, memory_bytes=device.memory_bytes,
                              hourly_price=0)
    fit = evaluate(shape, Request(context_length=CONTEXT, concurrency=CONCURRENCY), accelerator,
                   1)
    predicted = kv_cache_tokens(shape, kv_bytes=fit.kv_available_per_gpu)
    loaded, available = LOADED.search(text), AVAILABLE.search(text)
    return {"model": name, "device": device.name, "start_s": round(seconds, 1),
            "kv_tokens_logged": logged, "kv_tokens_predicted": predicted,
            "error_pct": round(abs(predicted - logged) / logged * 100, 3) if logged else None,
            "weights_gib_predicted": round(fit.weight_bytes_per_gpu / 2**30, 2),
            "weights_gib_logged": float(loaded.group(1)) if loaded else None,
            "kv_gib_predicted": round(fit.kv_available_per_gpu / 2**30, 2),
            "kv_gib_logged": float(available.group(1)) if available else None}


def offload_row(base: Path, device: devices.Device) -> dict:
    name = "llama-3.1-8b"
    folder = model_dir(name, base)
    process, spec, seconds = start(name, folder, device, base / "offload.log",
                                   KVPolicy(host_tier_gib=16))
    try:
        verdict = offload_check.run(address=address_of(spec), model=name, disk_tier=False,
                                    prefix_caching=spec.kv_policy.prefix_caching,
                                    context_length=spec.max_model_len)
    finally:
        processes.stop_group(process.pid, grace=15)
    return {"model": name, "host_tier_gib": 16, "start_s": round(seconds, 1),
            "first_s": verdict.figures["first_s"], "second_s": verdict.figures["second_s"],
            "offload_figures": verdict.figures, "offload_verdict": verdict.message,
            "offload_works": verdict.works}


def main() -> int:
    found = devices.detect(Path(tempfile.gettempdir()))
    if not found.devices:
        print("gpu-check: no NVIDIA GPU here (nvidia-smi finds none); run it on a GPU host. "
              "Nothing was measured.")
        return 0
    device = found.devices[0]
    base = Path(tempfile.mkdtemp(prefix="kvrun-gpu-check-"))
    rows = [capacity_row(name, base, device) for name in SHAPES]
    offload = offload_row(base, device)
    result = {"context": CONTEXT, "concurrency": CONCURRENCY, "capacity": rows,
              "offload": offload, "goal_error_pct": GOAL_ERROR_PCT}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ngpu-check on {device.name} ({device.memory_bytes / 2**30:.0f} GiB), "
          f"context {CONTEXT:,} × {CONCURRENCY}")
    print(f"  {'model':<16}{'start':>8}{'KV logged':>12}{'predicted':>12}{'error':>8}"
          f"{'weights (log/pred)':>22}{'KV GiB (log/pred)':>20}")
    for row in rows:
        print(f"  {row['model']:<16}{row['start_s']:>7.1f}s{row['kv_tokens_logged'] or 0:>12,}"
              f"{row['kv_tokens_predicted']:>12,}{row['error_pct'] or 0:>7.2f}%"
              f"{row['weights_gib_logged'] or 0:>11.2f}/{row['weights_gib_predicted']:<10.2f}"
              f"{row['kv_gib_logged'] or 0:>9.2f}/{row['kv_gib_predicted']:<10.2f}")
    print(f"  host tier 16 GiB: {offload['offload_verdict']} (start {offload['start_s']:.1f} s)")
    met = all(row["error_pct"] is not None and row["error_pct"] <= GOAL_ERROR_PCT
              for row in rows) and offload["offload_works"]
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
