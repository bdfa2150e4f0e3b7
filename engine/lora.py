"""LoRA adapters: what one states, whether it fits a model, and the device memory an engine
keeps for them. Pure Python, no Django.

An adapter is PEFT's layout: `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
`base_model_name_or_path`) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.<i>.<block>.<module>.lora_A.weight` ([r, in]) and `lora_B`
([out, r]). Admission reads both and checks every tensor against the model's shape, so an
adapter that vLLM would refuse, or load into the wrong layers, is refused with a sentence
before any engine sees it.

Device memory follows vLLM 0.32's `create_lora_weights`: an engine started with LoRA keeps,
for each of `--max-loras` slots, rank `--max-lora-rank` A and B matrices for every linear
layer of the model and for its embedding and output head, whatever the adapters target.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The ranks vLLM's --max-lora-rank takes.
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The linear layers of a dense decoder (Llama, Mistral, Qwen, Gemma, Phi-3 once split):
# the names adapters target, with the attention block or the MLP they sit in.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES
TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class AdapterRefusal(ValueError):
    """Why an adapter cannot be served by an endpoint, in words a person can act on."""


@dataclass(frozen=True)
class LoraShape:
    """The dimensions of a model that its adapters' matrices and vLLM's LoRA slots follow."""

    layers: int
    hidden_size: int
    intermediate_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int

    def dimensions(self, module: str) -> tuple[int, int]:
        """(in, out) of one linear layer."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q, kv = self.attention_heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                "o_proj": (q, hidden), "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[module]


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter states of itself (adapter_config.json)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> AdapterConfig:
        """Read a PEFT adapter config; raise AdapterRefusal for one vLLM cannot serve."""
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise AdapterRefusal(f"This adapter is a {config.get('peft_type')} adapter; kvrun "
                                 "serves LoRA adapters only.")
        rank = config.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterRefusal("adapter_config.json states no rank: its 'r' must be a "
                                 "positive whole number.")
        pattern = config.get("rank_pattern") or {}
        if not isinstance(pattern, dict) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 1
                for r in pattern.values()):
            raise AdapterRefusal("adapter_config.json's rank_pattern must map module names to "
                                 "positive whole ranks.")
        ranks = [rank, *pattern.values()]
        alpha = config.get("lora_alpha") or rank
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise AdapterRefusal("adapter_config.json's lora_alpha must be a number.")
        targets = config.get("target_modules")
        if isinstance(targets, str):
            raise AdapterRefusal("adapter_config.json names its target modules by a pattern "
                                 f"({targets!r}); kvrun needs them listed by name, such as "
                                 '["q_proj", "v_proj"].')
        if not isinstance(targets, list) or not targets:
            raise AdapterRefusal("adapter_config.json names no target_modules.")
        unsupported = [
            words for words, unsupported in (
                ("DoRA", config.get("use_dora")), ("a bias", config.get("bias", "none") != "none"),
                ("modules_to_save", config.get("modules_to_save")),
                ("layer_replication", config.get("layer_replication")))
            if unsupported]
        if unsupported:
            raise AdapterRefusal(f"This adapter uses {', '.join(unsupported)}, which vLLM cannot "
                                 "serve: train it as a plain LoRA adapter.")
        return cls(rank=max(ranks), alpha=float(alpha),
                   target_modules=tuple(sorted(str(t) for t in targets)),
                   base_model=str(config.get("base_model_name_or_path") or ""))


def admit(config: AdapterConfig, tensors: Mapping[str, list[int]], *, shape: LoraShape,
          max_rank: int, base_names: tuple[str, ...]) -> None:
    """Check an adapter against the endpoint that would serve it: the model it was trained on
    (when it names one, it must be one of `base_names`), its rank against the endpoint's
    `max_rank`, its target modules against the model's layers, and each tensor's shape against
    them. `tensors` maps each tensor's name to its shape. Raises AdapterRefusal."""
    if config.base_model and base_names and config.base_model not in base_names:
        raise AdapterRefusal(f"This adapter was trained on {config.base_model}, and this "
                             f"endpoint serves {base_names[0]}: an adapter works only on the "
                             "model it was trained on.")
    if config.rank > max_rank:
        raise AdapterRefusal(f"This adapter has rank {config.rank}, above this endpoint's "
                             f"largest LoRA rank, {max_rank}: raise the endpoint's "
                             "lora_max_rank, or train the adapter at a lower rank.")
    unknown = [name for name in config.target_modules if name not in MODULES]
    if unknown:
        raise AdapterRefusal(f"This adapter targets {', '.join(unknown)}, which kvrun does not "
                             f"find in this model; it serves adapters on {', '.join(MODULES)}.")
    if not tensors:
        raise AdapterRefusal(f"{WEIGHTS_FILE} holds no tensors.")
    for name, dims in tensors.items():
        found = TENSOR_NAME.match(name)
        if found is None:
            raise AdapterRefusal(f"{WEIGHTS_FILE} holds {name!r}, which is not a LoRA matrix "
                                 "of a decoder layer (base_model.model.model.layers.<i>…"
                                 "lora_A.weight).")
        layer, module, matrix = int(found[1]), found[2], found[3]
        if len(dims) != 2:
            raise AdapterRefusal(f"{name} has {len(dims)} dimensions; a LoRA matrix has 2.")
        if layer >= shape.layers or module not in config.target_modules:
            raise AdapterRefusal(f"{WEIGHTS_FILE} holds {name!r}, but this model has "
                                 f"{shape.layers} layers and the adapter targets "
                                 f"{', '.join(config.target_modules)}.")
        size_in, size_out = shape.dimensions(module)
        rank = dims[0] if matrix == "A" else dims[-1]
        expected = [rank, size_in] if matrix == "A" else [size_out, rank]
        if list(dims) != expected or rank > config.rank:
            raise AdapterRefusal(f"{name} is {dims}, where this model needs {expected} (rank "
                                 f"at most {config.rank}): the adapter was made for a model "
                                 "of another shape.")


def read_header(data: bytes) -> dict[str, list[int]]:
    """Each tensor's shape from the start of a safetensors file; raises AdapterRefusal when
    `data` is not one."""
    if len(data) < 8:
        raise AdapterRefusal(f"{WEIGHTS_FILE} is not a safetensors file.")
    (length,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + length])
        return {name: [int(size) for size in entry["shape"]] for name, entry in header.items()
                if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AdapterRefusal(f"{WEIGHTS_FILE} is not a safetensors file.") from exc


def device_bytes(shape: LoraShape, *, adapters: int, max_rank: int, tp: int = 1,
                 dtype: str = "bfloat16") -> int:
    """The device memory, per GPU, that vLLM keeps for `adapters` LoRA slots of rank
    `max_rank`: for each slot, an A and a B matrix on every linear layer (the column-parallel
    ones split B's output over the ranks, the row-parallel ones A's input), on the embedding
    and on the output head (split by vocabulary)."""
    if not adapters:
        return 0
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.attention_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = (3 * hidden + math.ceil((q + 2 * kv) / tp)  # q, k and v: A whole, B split
                 + math.ceil(q / tp) + hidden  # o: A split, B whole
                 + 2 * hidden + math.ceil(2 * inter / tp)  # gate and up
                 + math.ceil(inter / tp) + hidden)  # down
    vocab = math.ceil(shape.vocab_size / tp)
    per_slot = max_rank * (shape.layers * per_layer + 2 * (vocab + hidden))
    return adapters * per_slot * DTYPE_BYTES.get(dtype, 2)


def build_demo_adapter(directory: Path, *, seed: int, base_model: str, shape: LoraShape,
                       rank: int = 8, scale: float = 0.5) -> Path:
    """A random LoRA adapter on every attention projection of `shape`'s model, made offline and
    deterministically from `seed`, with weights large enough to change its answers (the demo
    model's and the benchmark's adapters)."""
    import numpy
    from safetensors.numpy import save_file

    random = numpy.random.default_rng(seed)
    tensors = {}
    for layer in range(shape.layers):
        for module in ATTENTION_MODULES:
            size_in, size_out = shape.dimensions(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                random.standard_normal((rank, size_in)) * scale).astype(numpy.float32)
            tensors[f"{prefix}.lora_B.weight"] = (
                random.standard_normal((size_out, rank)) * scale).astype(numpy.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(ATTENTION_MODULES),
        "base_model_name_or_path": base_model, "fan_in_fan_out": False}, indent=1))
    return directory
