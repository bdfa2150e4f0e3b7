"""Which tool-call and reasoning parsers fit a model (engine.parsers)."""

import json
from pathlib import Path

import pytest

from engine import demo_model, hf_checkpoint
from engine.parsers import MARKERS, chat_template_text, fitting, lacking, special_tokens

QWEN3_TOKENS = {"<tool_call>", "</tool_call>", "<think>", "</think>"}
DEEPSEEK_TOKENS = {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<think>", "</think>"}


@pytest.mark.parametrize(("architecture", "tokens", "template", "parsers"), [
    ("LlamaForCausalLM", {"<|python_tag|>", "<s>"}, "", ("llama3_json", "")),
    # A Llama 2 has no <|python_tag|>: vLLM would refuse to start with the parser.
    ("LlamaForCausalLM", {"<s>", "</s>"}, "", ("", "")),
    # Qwen3's thinking models let a request turn thinking off; the 2507 instruct models do
    # not think, and Qwen3-Coder writes XML calls.
    ("Qwen3ForCausalLM", QWEN3_TOKENS, "{% if enable_thinking %}", ("hermes", "qwen3")),
    ("Qwen3MoeForCausalLM", QWEN3_TOKENS, "<tool_call>{{ name }}", ("hermes", "")),
    ("Qwen3MoeForCausalLM", QWEN3_TOKENS, "<tool_call>\n<function=", ("qwen3_coder", "")),
    ("Qwen3ForCausalLM", {"<tool_call>"}, "enable_thinking", ("", "")),
    # V3 and R1 share an architecture and tokens; V3.1 dropped V3's ```json framing.
    ("DeepseekV3ForCausalLM", DEEPSEEK_TOKENS, "```json\n", ("deepseek_v3", "")),
    ("DeepseekV3ForCausalLM", DEEPSEEK_TOKENS, "<｜tool▁sep｜>", ("", "")),
    ("Gemma2ForCausalLM", {"<tool_call>"}, "", ("", "")),
])
def test_a_family_s_parser_fits_where_its_tokenizer_and_template_write_its_format(
        architecture: str, tokens: set[str], template: str, parsers: tuple[str, str]) -> None:
    assert fitting(architecture=architecture, tokens=tokens, chat_template=template) == parsers


def test_a_parser_named_by_a_person_is_checked_for_its_markers() -> None:
    assert lacking("llama3_json", tokens={"<tool_call>"}) == ("<|python_tag|>",)
    assert lacking("deepseek_r1", tokens=QWEN3_TOKENS) == ()
    assert lacking("pythonic", tokens=set()) == ()  # markers not known: vLLM judges
    assert set(MARKERS) >= {"llama3_json", "hermes", "mistral", "qwen3"}


def test_the_markers_are_read_from_the_tokens_a_tokenizer_adds() -> None:
    config = {"added_tokens_decoder": {"128010": {"content": "<|python_tag|>", "special": True},
                                       "3": {"content": "<s>"}},
              # Older files list these as AddedToken dicts.
              "additional_special_tokens": ["<think>", {"content": "</think>"}, 7]}

    assert special_tokens(config) == {"<|python_tag|>", "<s>", "<think>", "</think>"}
    assert special_tokens({}, {"added_tokens": [{"id": 3, "content": "<tool_call>"}]}) == {
        "<tool_call>"}
    assert special_tokens({}) == set()


def test_the_chat_template_is_read_wherever_the_tokenizer_keeps_it() -> None:
    assert chat_template_text({"chat_template": "{{ a }}"}) == "{{ a }}"
    assert chat_template_text({"chat_template": [{"name": "default", "template": "{{ a }}"},
                                                 {"name": "tool_use", "template": "{{ b }}"}]}
                              ) == "{{ a }}\n{{ b }}"
    assert chat_template_text({}, "{{ c }}") == "{{ c }}"


def test_a_checkpoint_imported_from_a_folder_gets_the_parsers_its_tokenizer_fits(
        tmp_path: Path) -> None:
    folder = demo_model.build(tmp_path / "demo")

    described = hf_checkpoint.describe(folder)
    assert (described["tool_call_parser"], described["reasoning_parser"]) == ("llama3_json", "")
    # Its tokenizer without the marker, wherever the files list it.
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [token for token in tokenizer["added_tokens"]
                                 if token["content"] != demo_model.TOOL_CALL_TOKEN]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert hf_checkpoint.describe(folder)["tool_call_parser"] == ""
