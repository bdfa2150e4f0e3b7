"""Which of vLLM's tool-call and reasoning parsers fits a model. Pure Python, no Django.

vLLM answers `tool_choice` other than "none" (a named tool too) only on an engine started
with a tool-call parser, and splits a reasoning model's thinking into the answer's `reasoning`
field only with a reasoning parser. Each parser reads the markers one family of models is
trained to write, and vLLM refuses to start an engine whose tokenizer lacks a parser's marker
tokens. So a model gets its family's parser only where its tokenizer has those tokens: a
Llama 2 (no `<|python_tag|>`) gets none, where a Llama 3.1 gets `llama3_json`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Parser:
    name: str  # as vLLM's --tool-call-parser or --reasoning-parser takes it
    tokens: tuple[str, ...]  # what the tokenizer must have: the markers the parser reads


LLAMA3_JSON = Parser("llama3_json", ("<|python_tag|>",))
HERMES = Parser("hermes", ("<tool_call>", "</tool_call>"))
MISTRAL = Parser("mistral", ("[TOOL_CALLS]",))
DEEPSEEK_V3 = Parser("deepseek_v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"))
THINK = ("<think>", "</think>")

# By the architecture a checkpoint's config names: the parser its family's instruct models
# write for, where the tokenizer has its markers.
TOOL_CALL_PARSERS = {
    "LlamaForCausalLM": LLAMA3_JSON,
    "Qwen2ForCausalLM": HERMES,
    "Qwen3ForCausalLM": HERMES,
    "Qwen3MoeForCausalLM": HERMES,
    "MistralForCausalLM": MISTRAL,
    "MixtralForCausalLM": MISTRAL,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
}
# Not DeepSeek's: V3 and R1 share an architecture and tokens, and R1's parser reads all of an
# answer without its closing marker as reasoning. A person names it for R1.
REASONING_PARSERS = {
    "Qwen3ForCausalLM": Parser("qwen3", THINK),
    "Qwen3MoeForCausalLM": Parser("qwen3", THINK),
}


def fitting(*, architecture: str, tokens: Collection[str]) -> tuple[str, str]:
    """The (tool-call, reasoning) parsers of `architecture`'s family whose markers are among
    the tokenizer's `tokens`; "" where none fits."""
    found = []
    for table in (TOOL_CALL_PARSERS, REASONING_PARSERS):
        parser = table.get(architecture)
        found.append(parser.name if parser and set(parser.tokens) <= set(tokens) else "")
    return found[0], found[1]


def special_tokens(tokenizer_config: dict, tokenizer: dict | None = None) -> set[str]:
    """The tokens a tokenizer adds to its vocabulary, where the markers live: as
    tokenizer_config.json lists them, or (Transformers 5 writes them there alone) as
    tokenizer.json does."""
    added = tokenizer_config.get("added_tokens_decoder") or {}
    found = {entry.get("content") for entry in added.values() if isinstance(entry, dict)}
    found.update(token for token in tokenizer_config.get("additional_special_tokens") or [])
    found.update(entry.get("content") for entry in (tokenizer or {}).get("added_tokens") or []
                 if isinstance(entry, dict))
    return {token for token in found if isinstance(token, str)}


def needs_tokenizer_json(tokenizer_config: dict) -> bool:
    """Whether the added tokens are to be read from tokenizer.json (a large file)."""
    return not tokenizer_config.get("added_tokens_decoder")
