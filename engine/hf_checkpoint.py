"""Read a local Hugging Face checkpoint's shape: config.json and the safetensors headers.

Pure Python, no Django, no torch: the headers alone give every tensor's shape, so the
parameter count needs no weights in memory.
"""

import json
import math
import struct
from pathlib import Path
from typing import Any

HEADER_LENGTH_BYTES = 8


def parameter_count(directory: Path) -> int:
    """Sum of every tensor's element count over the folder's *.safetensors files."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    total = 0
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(HEADER_LENGTH_BYTES))
            header = json.loads(handle.read(length))
        total += sum(math.prod(tensor["shape"]) for name, tensor in header.items()
                     if name != "__metadata__")
    return total


def describe(directory: Path) -> dict[str, Any]:
    """The catalog fields for the checkpoint in `directory`."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
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
        "slug": directory.name.lower().replace("_", "-"),
        "name": directory.name,
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "family": config.get("model_type", "unknown"),
        "parameters": parameter_count(directory),
        "layers": text["num_hidden_layers"],
        "hidden_size": hidden,
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
    }
