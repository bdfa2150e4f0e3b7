"""kvrun's demo model: a tiny random-weight Llama and a byte-level BPE tokenizer, built offline.

Deterministic from a seed, so every machine builds the same files; cached in a folder that a
real vLLM engine serves like any Hugging Face checkpoint. Its shape is the catalog's
`kvrun-demo-tiny` entry: head dim 64 because vLLM's CPU attention refuses smaller heads.

    python -m engine.demo_model DIR
"""

from __future__ import annotations

import fcntl
import json
import sys
from pathlib import Path

from engine.lora import LoraShape

SEED = 20261202
VOCAB_SIZE = 512
MAX_CONTEXT = 2048
CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": MAX_CONTEXT,
    "vocab_size": VOCAB_SIZE,
    "tie_word_embeddings": False,
}
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
MARKER = "kvrun-demo.json"


def build(directory: Path) -> Path:
    """Build the demo model into `directory` unless an identical build is already there.
    Safe to call from several threads and processes at once: the first builds (under a file
    lock, which also keeps transformers' lazy imports out of each other's way) and the others
    wait for it and find its build."""
    directory = Path(directory)
    recipe = {"seed": SEED, "config": CONFIG, "corpus": CORPUS}
    marker = directory / MARKER
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == recipe:
            return directory
        _build_tokenizer(directory)
        _build_weights(directory)
        marker.write_text(json.dumps(recipe))
    return directory


def _build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    # Pad the vocabulary to exactly VOCAB_SIZE so that every id the model can emit decodes.
    missing = VOCAB_SIZE - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<extra_{n}>" for n in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=MAX_CONTEXT,
    )
    fast.chat_template = (
        "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>"
        "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(directory)


def _build_weights(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**CONFIG, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


def lora_shape() -> LoraShape:
    """The dimensions the demo model's LoRA adapters follow."""
    return LoraShape(layers=CONFIG["num_hidden_layers"], hidden_size=CONFIG["hidden_size"],
                     intermediate_size=CONFIG["intermediate_size"],
                     attention_heads=CONFIG["num_attention_heads"],
                     kv_heads=CONFIG["num_key_value_heads"], head_dim=CONFIG["head_dim"],
                     vocab_size=VOCAB_SIZE)


def parameter_count() -> int:
    """Parameters of the demo model, computed from its shape (the catalog's figure)."""
    hidden, inter, layers = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG[
        "num_hidden_layers"]
    head_dim, heads, kv_heads = CONFIG["head_dim"], CONFIG["num_attention_heads"], CONFIG[
        "num_key_value_heads"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return 2 * VOCAB_SIZE * hidden + layers * per_layer + hidden


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
