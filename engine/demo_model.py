"""kvrun's built-in models: random-weight Llamas with one byte-level BPE tokenizer, built
offline.

Deterministic from a seed, so every machine builds the same files; cached in a folder that a
real vLLM engine serves like any Hugging Face checkpoint. Each shape is a catalog entry:
- `kvrun-demo-tiny`, the demo: 0.4 M parameters, loads in seconds, answers at once. Head dim
  64 because vLLM's CPU attention refuses smaller heads.
- `kvrun-demo-embed` and `kvrun-demo-rerank`, the demo's embedding model (the demo itself,
  which its engine converts) and its reranker (the demo's body under a random classifier's
  head of one label).
- `kvrun-bench-prefill`, for trials of the KV cache's governance on CPU engines: wide and deep
  enough that a prompt's prefill costs what a real model's does beside its decode steps, so
  that a prefix-cache hit saves time that can be measured (bench/kv.py records its figures).

    python -m engine.demo_model DIR [SLUG]
"""

from __future__ import annotations

import fcntl
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine.lora import LoraShape

SEED = 20261202
VOCAB_SIZE = 512


@dataclass(frozen=True)
class Shape:
    """A built-in model's architecture, as its config.json and the catalog state it."""

    hidden_size: int
    intermediate_size: int
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_context: int
    # A classifier's head of one label in place of the language model's: a cross-encoder,
    # which scores a query and a document read together.
    score_head: bool = False

    def config(self) -> dict[str, object]:
        config: dict[str, object] = {
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.layers, "num_attention_heads": self.attention_heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_context, "vocab_size": VOCAB_SIZE,
            "tie_word_embeddings": False}
        if self.score_head:  # the head reads the last token; padding marks where it is
            config |= {"num_labels": 1, "pad_token_id": 1}
        return config


TINY = Shape(hidden_size=128, intermediate_size=256, layers=2, attention_heads=2, kv_heads=1,
             head_dim=64, max_context=2048)
# Of the shapes measured on a CPU engine bound to one core (7 M, 19 M and 56 M parameters),
# the one whose 2,048-token prefill is well past 300 ms while a decode step stays a few
# milliseconds; bench/results/kv.json records its costs.
PREFILL_HEAVY = Shape(hidden_size=512, intermediate_size=1536, layers=6, attention_heads=8,
                      kv_heads=2, head_dim=64, max_context=4096)
# The demo's embedding model is the demo itself, which its engine converts to embed.
BUILT_IN = {"kvrun-demo-tiny": TINY, "kvrun-bench-prefill": PREFILL_HEAVY,
            "kvrun-demo-embed": TINY, "kvrun-demo-rerank": replace(TINY, score_head=True)}
CORPUS = [
    "kvrun serves open language models on dedicated GPUs behind an OpenAI-compatible API.",
    "The key-value cache holds the attention keys and values of every token in the context.",
    "Decode reads the whole cache at every step, so memory bounds how many requests run at once.",
    "Prefix caching reuses the blocks of a prompt that another request already computed.",
    "A tenant's cached prefixes are salted so that no other tenant can reuse them.",
    "Every prompt token and every generated token is metered and billed per GPU second.",
    "The quick brown fox jumps over the lazy dog while the engine streams tokens to the client.",
    "Hello, world! How are you today? Tell me a story about a cache that never forgot.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? . , ; : ' \" @ # $ % ^ & _ | ~ `",
]
# The token Llama 3's tool-call parser (vLLM's llama3_json) looks for: an engine refuses to
# start with a parser whose tokens its tokenizer lacks, and the demo serves tools like a Llama.
TOOL_CALL_TOKEN = "<|python_tag|>"
CHAT_TEMPLATE = (
    "{% if tools %}<s>tools: {{ tools | tojson }}</s>{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
MARKER = "kvrun-demo.json"
BUILD_LOCK = ".kvrun-built-in.lock"


def build(directory: Path, shape: Shape = TINY) -> Path:
    """Build the model of `shape` into `directory` unless an identical build is already there.
    Safe to call from several threads and processes at once: the first builds (under a file
    lock beside every built-in model's folder, which also keeps transformers' lazy imports
    out of each other's way when two models are built at once) and the others wait for it
    and find its build."""
    directory = Path(directory)
    recipe = {"seed": SEED, "config": shape.config(), "corpus": CORPUS,
              "special_tokens": [TOOL_CALL_TOKEN], "chat_template": CHAT_TEMPLATE}
    marker = directory / MARKER
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / BUILD_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == recipe:
            return directory
        _build_tokenizer(directory, shape.max_context)
        _build_weights(directory, shape)
        marker.write_text(json.dumps(recipe))
    return directory


def _build_tokenizer(directory: Path, max_context: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<unk>", TOOL_CALL_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    # Pad the vocabulary to exactly VOCAB_SIZE so that every id the model can emit decodes.
    missing = VOCAB_SIZE - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<extra_{n}>" for n in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=max_context,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def _build_weights(directory: Path, shape: Shape) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(SEED)
    config = LlamaConfig(**shape.config(), bos_token_id=0, eos_token_id=1,
                         torch_dtype="bfloat16")
    kind = LlamaForSequenceClassification if shape.score_head else LlamaForCausalLM
    model = kind(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


def lora_shape(shape: Shape = TINY) -> LoraShape:
    """The dimensions the LoRA adapters of the model of `shape` follow."""
    return LoraShape(layers=shape.layers, hidden_size=shape.hidden_size,
                     intermediate_size=shape.intermediate_size,
                     attention_heads=shape.attention_heads, kv_heads=shape.kv_heads,
                     head_dim=shape.head_dim, vocab_size=VOCAB_SIZE)


def parameter_count(shape: Shape = TINY) -> int:
    """Parameters of the model of `shape`, computed from it (the catalog's figure)."""
    attention = shape.hidden_size * shape.head_dim * (2 * shape.attention_heads
                                                      + 2 * shape.kv_heads)
    per_layer = attention + 3 * shape.hidden_size * shape.intermediate_size + 2 * shape.hidden_size
    head = shape.hidden_size if shape.score_head else VOCAB_SIZE * shape.hidden_size
    return VOCAB_SIZE * shape.hidden_size + head + shape.layers * per_layer + shape.hidden_size


def described(shape: Shape) -> dict[str, object]:
    """The shape and its parameter count, as a benchmark records the model it ran."""
    return {**asdict(shape), "parameters": parameter_count(shape)}


if __name__ == "__main__":
    slug = sys.argv[2] if len(sys.argv) > 2 else "kvrun-demo-tiny"
    print(build(Path(sys.argv[1]), BUILT_IN[slug]))
