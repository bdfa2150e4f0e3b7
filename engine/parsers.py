"""Which of vLLM's tool-call and reasoning parsers fits a model. Pure Python, no Django.

vLLM answers `tool_choice` other than "none" (a named tool too) only on an engine started
with a tool-call parser, and splits a reasoning model's thinking into the answer's `reasoning`
field only with a reasoning parser. Each parser reads the markers one family of models is
trained to write; for most (not `hermes`) vLLM refuses to start an engine whose tokenizer
lacks them. So a model gets its family's parser only where its tokenizer has those tokens
and its chat template writes that family's format: a Llama 2 (no `<|python_tag|>`) gets
none, where a Llama 3.1 gets `llama3_json`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

THINK = ("<think>", "</think>")
# The tokens each parser reads, by its name as vLLM's --tool-call-parser or
# --reasoning-parser takes it; a parser named by a person is checked against these too.
MARKERS = {
    "llama3_json": ("<|python_tag|>",),
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]",),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    "qwen3": THINK,
    "deepseek_r1": THINK,
}


def _qwen3_tools(template: str) -> str:
    # Qwen3-Coder writes XML inside <tool_call>, which hermes does not read.
    return "qwen3_coder" if "<function=" in template else "hermes"


# By the architecture a checkpoint's config names, then by what its chat template writes:
# the parser its family's instruct models write for.
TOOL_CALL_PARSERS: dict[str, Callable[[str], str]] = {
    "LlamaForCausalLM": lambda template: "llama3_json",
    "Qwen2ForCausalLM": lambda template: "hermes",
    "Qwen3ForCausalLM": _qwen3_tools,
    "Qwen3MoeForCausalLM": _qwen3_tools,
    "MistralForCausalLM": lambda template: "mistral",
    "MixtralForCausalLM": lambda template: "mistral",
    # V3 frames arguments in ```json, which V3.1 (the same architecture) dropped.
    "DeepseekV3ForCausalLM": lambda template: "deepseek_v3" if "```json" in template else "",
}
def _qwen3_reasoning(template: str) -> str:
    return "qwen3" if "enable_thinking" in template else ""


# Qwen3's own thinking models only (their template lets a request turn thinking off): the
# 2507 instruct models share the tokens but never think, and the parser would read their
# whole answer as thinking. DeepSeek's R1 parser is a person's choice for the same reason.
REASONING_PARSERS: dict[str, Callable[[str], str]] = {
    "Qwen3ForCausalLM": _qwen3_reasoning,
    "Qwen3MoeForCausalLM": _qwen3_reasoning,
}


def fitting(*, architecture: str, tokens: Collection[str], chat_template: str
            ) -> tuple[str, str]:
    """The (tool-call, reasoning) parsers of `architecture`'s family that its chat template
    writes for and whose markers are among the tokenizer's `tokens`; "" where none fits."""
    found = []
    for table in (TOOL_CALL_PARSERS, REASONING_PARSERS):
        choose = table.get(architecture)
        name = choose(chat_template) if choose else ""
        found.append(name if name and lacking(name, tokens=tokens) == () else "")
    return found[0], found[1]


def lacking(parser: str, *, tokens: Collection[str]) -> tuple[str, ...]:
    """The markers `parser` reads that the tokenizer lacks (none for a parser not listed)."""
    return tuple(marker for marker in MARKERS.get(parser, ()) if marker not in tokens)


def special_tokens(tokenizer_config: dict, tokenizer: dict | None = None) -> set[str]:
    """The tokens a tokenizer adds to its vocabulary, where the markers live: as
    tokenizer_config.json lists them and as tokenizer.json does (Transformers 5 writes them
    there alone)."""
    entries = [*(tokenizer_config.get("added_tokens_decoder") or {}).values(),
               *(tokenizer_config.get("additional_special_tokens") or []),
               *((tokenizer or {}).get("added_tokens") or [])]
    found = {entry.get("content") if isinstance(entry, dict) else entry for entry in entries}
    return {token for token in found if isinstance(token, str)}


def chat_template_text(tokenizer_config: dict, separate: str = "") -> str:
    """The chat template's text: a chat_template.jinja file's (`separate`), or the one (or
    all the named ones) in tokenizer_config.json."""
    template = tokenizer_config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: [{"name", "template"}]
        template = "\n".join(str(entry.get("template", "")) for entry in template
                             if isinstance(entry, dict))
    return separate or str(template)
