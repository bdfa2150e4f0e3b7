"""LoRA adapters (engine.lora): what an adapter states, admission against a model, and the
device memory an engine keeps for its LoRA slots."""

import json
from decimal import Decimal
from pathlib import Path

import pytest

from engine import demo_model, lora, sizing
from engine.supervisor import EngineSpec, build_command

SHAPE = demo_model.lora_shape()


def config(**changes: object) -> dict:
    return {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none",
            "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "kvrun/demo",
            **changes}


def tensors(rank: int = 8, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> dict:
    found = {}
    for layer in range(SHAPE.layers):
        for module in modules:
            size_in, size_out = SHAPE.dimensions(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            found[f"{prefix}.lora_A.weight"] = [rank, size_in]
            found[f"{prefix}.lora_B.weight"] = [size_out, rank]
    return found


def admit(stated: dict, shapes: dict, *, max_rank: int = 16) -> None:
    lora.admit(lora.AdapterConfig.of(stated), shapes, shape=SHAPE, max_rank=max_rank,
               base_names=("kvrun/demo", "kvrun-demo-tiny"))


def test_an_adapter_made_for_the_model_is_admitted() -> None:
    admit(config(), tensors())
    stated = lora.AdapterConfig.of(config(rank_pattern={"q_proj": 16}))
    assert (stated.rank, stated.alpha, stated.target_modules) == (16, 16.0, ("q_proj", "v_proj"))


@pytest.mark.parametrize(("stated", "shapes", "words"), [
    (config(base_model_name_or_path="meta-llama/Llama-3.1-8B"), tensors(),
     "trained on meta-llama/Llama-3.1-8B, and this endpoint serves kvrun/demo"),
    (config(r=32), tensors(32), "rank 32, above this endpoint's largest LoRA rank, 16"),
    (config(target_modules=["q_proj", "lm_head"]), tensors(), "targets lm_head"),
    (config(target_modules="all-linear"), tensors(), "by a pattern"),
    (config(use_dora=True), tensors(), "uses DoRA"),
    (config(peft_type="IA3"), tensors(), "kvrun serves LoRA adapters only"),
    (config(r=0), tensors(), "states no rank"),
    (config(), {**tensors(), "base_model.model.lm_head.weight": [512, 128]}, "not a LoRA matrix"),
    (config(), {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": [8, 128]},
     "this model has 2 layers"),
    (config(), {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [8, 4096]},
     "where this model needs [8, 128]"),
    (config(), {}, "holds no tensors"),
    (config(rank_pattern=["q_proj"]), tensors(), "rank_pattern must map module names"),
    (config(rank_pattern={"q_proj": "sixteen"}), tensors(), "rank_pattern must map"),
    (config(lora_alpha="high"), tensors(), "lora_alpha must be a number"),
])
def test_an_adapter_that_does_not_fit_is_refused_saying_why(stated: dict, shapes: dict,
                                                            words: str) -> None:
    with pytest.raises(lora.AdapterRefusal, match=words.replace("[", r"\[")):
        admit(stated, shapes)


def test_an_adapter_that_names_no_base_model_is_judged_by_its_shapes() -> None:
    admit(config(base_model_name_or_path=""), tensors())


def test_the_demo_adapter_is_deterministic_and_admitted(tmp_path: Path) -> None:
    first = lora.build_demo_adapter(tmp_path / "a", seed=1, base_model="kvrun/demo",
                                    shape=SHAPE)
    again = lora.build_demo_adapter(tmp_path / "b", seed=1, base_model="kvrun/demo",
                                    shape=SHAPE)
    other = lora.build_demo_adapter(tmp_path / "c", seed=2, base_model="kvrun/demo",
                                    shape=SHAPE)
    weights = [(folder / lora.WEIGHTS_FILE).read_bytes() for folder in (first, again, other)]
    assert weights[0] == weights[1] != weights[2]
    stated = json.loads((first / lora.CONFIG_FILE).read_text())
    admit(stated, lora.read_header(weights[0]))


def test_a_file_that_is_not_safetensors_is_refused() -> None:
    with pytest.raises(lora.AdapterRefusal, match="not a safetensors file"):
        lora.read_header(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(lora.AdapterRefusal, match="not a safetensors file"):
        lora.read_header(b"abc")
    listed = b"[1, 2]"
    with pytest.raises(lora.AdapterRefusal, match="not a safetensors file"):
        lora.read_header(len(listed).to_bytes(8, "little") + listed)


def test_device_memory_counts_every_slot_at_the_largest_rank() -> None:
    # Per slot at rank 16, by hand for the demo model (hidden 128, MLP 256, 2 heads and one
    # KV head of 64, vocabulary 512, 2 layers): q/k/v A 3x128 + B (128+64+64), o A 128 + B
    # 128, gate/up A 2x128 + B 512, down A 256 + B 128, per layer; embedding and head
    # 2 x (512 + 128).
    per_layer = 3 * 128 + 256 + 128 + 128 + 2 * 128 + 512 + 256 + 128
    per_slot = 16 * (2 * per_layer + 2 * (512 + 128))
    assert lora.device_bytes(SHAPE, adapters=4, max_rank=16) == 4 * per_slot * 2
    assert lora.device_bytes(SHAPE, adapters=0, max_rank=16) == 0
    assert lora.device_bytes(SHAPE, adapters=1, max_rank=16, dtype="float32") == per_slot * 4
    # Over 2 GPUs the split halves of B (column-parallel) and A (row-parallel) halve.
    split = 3 * 128 + 128 + 64 + 128 + 2 * 128 + 256 + 128 + 128
    assert lora.device_bytes(SHAPE, adapters=1, max_rank=16, tp=2) == (
        16 * (2 * split + 2 * (256 + 128)) * 2)


def test_lora_slots_come_out_of_the_kv_cache() -> None:
    model = sizing.ModelShape(name="m", parameters=8_030_261_248, layers=32,
                              attention_heads=32, kv_heads=8, head_dim=128, max_context=131072,
                              lora=lora.LoraShape(layers=32, hidden_size=4096,
                                                  intermediate_size=14336, attention_heads=32,
                                                  kv_heads=8, head_dim=128, vocab_size=128256))
    h100 = sizing.Accelerator(slug="h100", name="H100", memory_bytes=80 * sizing.GIB,
                              hourly_price=Decimal("2.5"))
    plain = sizing.evaluate(model, sizing.Request(context_length=8192, concurrency=8), h100, 1)
    adapters = sizing.evaluate(model, sizing.Request(context_length=8192, concurrency=8,
                                                     lora_adapters=4, lora_max_rank=16), h100, 1)
    taken = lora.device_bytes(model.lora, adapters=4, max_rank=16)  # type: ignore[arg-type]
    assert adapters.lora_bytes_per_gpu == taken > 0
    assert plain.kv_available_per_gpu - adapters.kv_available_per_gpu == taken
    text = sizing.explain(model, sizing.Request(context_length=8192, concurrency=8,
                                                lora_adapters=4, lora_max_rank=16), None, [])
    assert "+ LoRA" in text and "4 adapter(s) of rank 16" in text


def test_an_engine_with_adapters_starts_with_lora_and_runtime_loading() -> None:
    argv, env = build_command(EngineSpec(model_dir="/m", served_model_name="chat", port=1,
                                         max_model_len=2048, max_num_seqs=4, lora_adapters=2,
                                         lora_max_rank=8, lora_host_adapters=6),
                              python="python")
    joined = " ".join(argv)
    assert "--enable-lora --max-loras 2 --max-lora-rank 8 --max-cpu-loras 6" in joined
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = build_command(EngineSpec(model_dir="/m", served_model_name="chat", port=1,
                                         max_model_len=2048, max_num_seqs=4), python="python")
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
