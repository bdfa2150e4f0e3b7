"""Which tool-call and reasoning parsers fit a model (engine.parsers)."""

import json
from pathlib import Path

from engine import demo_model, hf_checkpoint
from engine.parsers import fitting, special_tokens


def test_a_family_s_parser_fits_only_a_tokenizer_that_has_its_markers() -> None:
    assert fitting(architecture="LlamaForCausalLM", tokens={"<|python_tag|>", "<s>"}) == (
        "llama3_json", "")
    # A Llama 2 has no <|python_tag|>: vLLM would refuse to start with the parser.
    assert fitting(architecture="LlamaForCausalLM", tokens={"<s>", "</s>"}) == ("", "")
    assert fitting(architecture="Qwen3ForCausalLM",
                   tokens={"<tool_call>", "</tool_call>", "<think>", "</think>"}) == (
        "hermes", "qwen3")
    assert fitting(architecture="Qwen3ForCausalLM", tokens={"<tool_call>"}) == ("", "")
    # V3 and R1 share an architecture: R1's reasoning parser is a person's choice.
    assert fitting(architecture="DeepseekV3ForCausalLM", tokens={
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<think>", "</think>"}) == (
        "deepseek_v3", "")
    assert fitting(architecture="Gemma2ForCausalLM", tokens={"<tool_call>"}) == ("", "")


def test_the_markers_are_read_from_the_tokens_a_tokenizer_adds() -> None:
    config = {"added_tokens_decoder": {"128010": {"content": "<|python_tag|>", "special": True},
                                       "3": {"content": "<s>"}},
              "additional_special_tokens": ["<think>", 7]}

    assert special_tokens(config) == {"<|python_tag|>", "<s>", "<think>"}
    assert special_tokens({}, {"added_tokens": [{"id": 3, "content": "<tool_call>"}]}) == {
        "<tool_call>"}
    assert special_tokens({}) == set()


def test_a_checkpoint_imported_from_a_folder_gets_the_parsers_its_tokenizer_fits(
        tmp_path: Path) -> None:
    folder = demo_model.build(tmp_path / "demo")

    described = hf_checkpoint.describe(folder)
    assert (described["tool_call_parser"], described["reasoning_parser"]) == ("llama3_json", "")
    # Its tokenizer without the marker (Transformers 5 lists added tokens in tokenizer.json).
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [token for token in tokenizer["added_tokens"]
                                 if token["content"] != demo_model.TOOL_CALL_TOKEN]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert hf_checkpoint.describe(folder)["tool_call_parser"] == ""
