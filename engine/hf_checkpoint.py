"""A Hugging Face checkpoint's shape: config.json and the safetensors headers.

Pure Python, no Django, no torch: the headers alone give every tensor's shape and byte
range, so neither the parameter count nor the weights' size needs the weights in memory.
A local folder (`describe`) and a hub repository read by range requests (engine.hub) give
their headers and config to the same `describe_config`, so both size a checkpoint alike.
"""

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import parsers, tasks

HEADER_LENGTH_BYTES = 8


@dataclass(frozen=True)
class Tensors:
    """What a checkpoint's safetensors headers say of its weights, as the files store them
    (a quantized checkpoint's packed integers counted as they are packed)."""

    parameters: int
    weights_bytes: int

    @classmethod
    def of_headers(cls, headers: Iterable[Mapping[str, Any]]) -> "Tensors":
        """From parsed headers: {tensor name: {dtype, shape, data_offsets}}, one per file."""
        parameters = weights = 0
        for header in headers:
            for name, tensor in header.items():
                if name == "__metadata__":
                    continue
                parameters += math.prod(tensor["shape"])
                start, end = tensor["data_offsets"]
                weights += end - start
        return cls(parameters=parameters, weights_bytes=weights)


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(HEADER_LENGTH_BYTES))
        return dict(json.loads(handle.read(length)))


def tensors_in(directory: Path) -> Tensors:
    """The tensors of every *.safetensors file in the folder."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    return Tensors.of_headers(read_header(path) for path in files)


def parameter_count(directory: Path) -> int:
    """Sum of every tensor's element count over the folder's *.safetensors files."""
    return tensors_in(directory).parameters


def describe(directory: Path) -> dict[str, Any]:
    """The catalog fields for the checkpoint in `directory`."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    fields = describe_config(config, tensors_in(directory))
    tokenizer_config, tokenizer = (
        json.loads((directory / name).read_text()) if (directory / name).exists() else {}
        for name in ("tokenizer_config.json", "tokenizer.json"))
    template = directory / "chat_template.jinja"
    fields["tool_call_parser"], fields["reasoning_parser"] = parsers.fitting(
        architecture=fields["architecture"],
        tokens=parsers.special_tokens(tokenizer_config, tokenizer),
        chat_template=parsers.chat_template_text(
            tokenizer_config, template.read_text() if template.exists() else ""))
    return {"slug": directory.name.lower().replace("_", "-"), "name": directory.name, **fields}


def describe_config(config: Mapping[str, Any], tensors: Tensors) -> dict[str, Any]:
    """The catalog's sizing fields from a config.json and the checkpoint's tensors."""
    text = config.get("text_config", config)  # multimodal wrappers keep the LM's numbers here
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    kv_lora_rank = text.get("kv_lora_rank")
    window = text.get("sliding_window") if text.get("use_sliding_window", True) else None
    layer_types = text.get("layer_types") or []
    sliding_layers = sum(1 for kind in layer_types if kind == "sliding_attention")
    if window and not layer_types:
        sliding_layers = text["num_hidden_layers"]
    kv_heads = text.get("num_key_value_heads") or heads
    return {
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "family": config.get("model_type", "unknown"),
        "parameters": tensors.parameters,
        "weights_bytes": tensors.weights_bytes,
        "layers": text["num_hidden_layers"],
        "hidden_size": hidden,
        "intermediate_size": text.get("intermediate_size"),
        "attention_heads": heads,
        "kv_heads": kv_heads,
        "head_dim": text.get("head_dim") or hidden // heads,
        "vocab_size": text["vocab_size"],
        "max_context": text.get("max_position_embeddings", 2048),
        "attention_kind": "mla" if kv_lora_rank else ("mha" if kv_heads == heads else "gqa"),
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": text.get("qk_rope_head_dim") if kv_lora_rank else None,
        "sliding_window": window if sliding_layers else None,
        "sliding_window_layers": sliding_layers or None,
        "default_dtype": str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        "task": tasks.detected(config),
    }
