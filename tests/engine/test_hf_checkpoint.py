import json
import struct
from pathlib import Path

import pytest

from engine import demo_model
from engine.hf_checkpoint import describe, parameter_count


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
              for name, shape in shapes.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_it_counts_parameters_across_shards_from_headers(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [4, 8], "b": [8]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [2, 3, 5]})

    assert parameter_count(tmp_path) == 32 + 8 + 30


def test_it_describes_an_mla_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}))
    write_safetensors(tmp_path / "model.safetensors", {"w": [10]})

    fields = describe(tmp_path)

    assert (fields["attention_kind"], fields["kv_lora_rank"], fields["qk_rope_head_dim"]) == (
        "mla", 512, 64)


def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        parameter_count(tmp_path)


@pytest.mark.django_db
def test_import_model_adds_the_demo_checkpoint(tmp_path: Path) -> None:
    from django.core.management import call_command

    from endpoints.models import ModelSpec

    folder = demo_model.build(tmp_path / "tiny-demo")
    call_command("import_model", str(folder), "--licence", "apache-2.0")

    model = ModelSpec.objects.get(slug="tiny-demo")
    assert model.parameters == demo_model.parameter_count() == 426_624
    assert (model.layers, model.attention_heads, model.kv_heads, model.head_dim) == (2, 2, 1, 64)
    assert (model.vocab_size, model.max_context, model.attention_kind) == (512, 2048, "gqa")
    assert model.architecture == "LlamaForCausalLM"


def test_the_demo_model_is_the_same_on_every_build(tmp_path: Path) -> None:
    import hashlib

    def digest(folder: Path) -> dict[str, str]:
        return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
                for name in ("model.safetensors", "tokenizer.json", "config.json")}

    first = demo_model.build(tmp_path / "one")
    second = demo_model.build(tmp_path / "two")

    assert digest(first) == digest(second)
    assert demo_model.build(first) == first  # cached: an identical recipe is not rebuilt


def test_a_build_waits_for_any_already_under_way(tmp_path: Path) -> None:
    import fcntl
    import threading

    folder = tmp_path / "demo"
    folder.mkdir()
    # Another worker is building a model (this one or another: transformers' lazy imports
    # fail when two threads first import it at once).
    with open(tmp_path / demo_model.BUILD_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = threading.Thread(target=demo_model.build, args=(folder,))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()
        assert not (folder / demo_model.MARKER).exists()
    waiting.join(60)

    assert not waiting.is_alive()
    assert (folder / demo_model.MARKER).exists()


@pytest.mark.parametrize("slug", sorted(demo_model.BUILT_IN))
def test_each_built_in_model_is_what_its_catalog_entry_states(slug: str, tmp_path: Path) -> None:
    catalog = json.loads((Path(__file__).resolve().parents[2] / "endpoints" / "catalog"
                          / "models.json").read_text())
    [entry] = [row for row in catalog if row["slug"] == slug]
    shape = demo_model.BUILT_IN[slug]

    found = describe(demo_model.build(tmp_path / slug, shape))

    assert found["parameters"] == demo_model.parameter_count(shape) == entry["parameters"]
    names = {"slug", "name", "hf_repo", "family"}
    if entry["task"] != found["task"]:  # a generative checkpoint the catalog embeds with
        names |= {"task", "tool_call_parser", "reasoning_parser"}
    shared = {key for key in found if key in entry and key not in names}
    assert {"layers", "kv_heads", "head_dim", "max_context", "hidden_size"} <= shared
    assert {key: found[key] for key in shared} == {key: entry[key] for key in shared}
