"""Reading a repository on a hub without its weights (engine.hub), against the hub on loopback
(bench/hub_server.py) through the hub's own client."""

import json
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.hub_server import Hub
from engine import demo_model, hf_checkpoint, hub

READER, STRANGER = "hf_reader_token", "hf_stranger_token"


def write_checkpoint(folder: Path, *, shards: dict[str, dict[str, tuple[str, list[int]]]],
                     config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A checkpoint with real safetensors files (zeros) of the shapes and dtypes given."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4,
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}))
    if tokenizer is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    sizes = {"BF16": 2, "F32": 4, "I32": 4, "F8_E4M3": 1}
    for file, tensors in shards.items():
        header: dict[str, object] = {}
        offset = 0
        for name, (dtype, shape) in tensors.items():
            length = sizes[dtype] * math.prod(shape)
            header[name] = {"dtype": dtype, "shape": shape,
                            "data_offsets": [offset, offset + length]}
            offset += length
        raw = json.dumps(header).encode()
        (folder / file).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    if len(shards) > 1:
        weight_map = {name: file for file, tensors in shards.items() for name in tensors}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    server = Hub(tmp_path_factory.mktemp("hub")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model.build(tmp_path_factory.mktemp("demo") / "kvrun-demo-tiny")


def test_a_revision_resolves_to_its_commit_and_sizes_as_the_local_checkpoint(
        served: Hub, demo: Path, tmp_path: Path) -> None:
    first = served.publish("kvrun/demo", demo, tags=("v1",))
    later = shutil.copytree(demo, tmp_path / "later")
    (later / "generation_config.json").write_text("{}")
    second = served.publish("kvrun/demo", later)

    pinned = hub.inspect(endpoint=served.url, repo_id="kvrun/demo", revision="v1")
    latest = hub.inspect(endpoint=served.url, repo_id="kvrun/demo")

    assert (pinned.commit, latest.commit) == (first, second) and first != second
    assert hub.inspect(endpoint=served.url, repo_id="kvrun/demo", revision=first).commit == first
    local = hf_checkpoint.describe(demo)
    assert pinned.describe() == {k: v for k, v in local.items() if k not in ("slug", "name")}
    assert pinned.tensors.parameters == demo_model.parameter_count()
    assert pinned.tensors.weights_bytes == 2 * demo_model.parameter_count()  # bf16
    assert pinned.chat_template is True and pinned.remote_code is False
    weights = next(f for f in pinned.files if f.path == "model.safetensors")
    assert weights.sha256 and weights.size == (demo / "model.safetensors").stat().st_size
    assert pinned.download_bytes == sum(p.stat().st_size for p in demo.iterdir()
                                        if p.suffix in (".json", ".safetensors", ".jinja"))


def test_a_sharded_quantized_checkpoint_counts_what_its_files_state(
        served: Hub, tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "sharded", shards={
        "model-00001-of-00002.safetensors": {"a.qweight": ("I32", [64, 32]),
                                             "a.scales": ("BF16", [8, 256])},
        "model-00002-of-00002.safetensors": {"lm_head.weight": ("BF16", [1000, 256])}},
        tokenizer={"bos_token": "<s>"})
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 1000)  # never fetched
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text("{}")
    served.publish("kvrun/sharded", folder)

    found = hub.inspect(endpoint=served.url, repo_id="kvrun/sharded")

    assert found.tensors.parameters == 64 * 32 + 8 * 256 + 1000 * 256
    assert found.tensors.weights_bytes == 64 * 32 * 4 + 8 * 256 * 2 + 1000 * 256 * 2
    assert found.tensors == hf_checkpoint.tensors_in(folder)
    assert found.chat_template is False  # a tokenizer config without a template
    fetched = {f.path for f in hub.engine_files(found.files, remote_code=False)}
    assert fetched == {"config.json", "tokenizer_config.json", "model.safetensors.index.json",
                       "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_remote_code_is_seen_in_the_config(served: Hub, tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "custom", shards={"model.safetensors": {
        "w": ("BF16", [4, 4])}}, config={
        "architectures": ["CustomForCausalLM"], "auto_map": {"AutoModel": "modeling.Custom"},
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 1,
        "vocab_size": 100})
    (folder / "modeling.py").write_text("class Custom: ...\n")
    served.publish("kvrun/custom", folder)

    found = hub.inspect(endpoint=served.url, repo_id="kvrun/custom")

    assert found.remote_code and found.architecture == "CustomForCausalLM"
    assert "modeling.py" in {f.path for f in hub.engine_files(found.files, remote_code=True)}
    assert "modeling.py" not in {f.path for f in hub.engine_files(found.files, remote_code=False)}


def refusal(served: Hub, repo_id: str, **kwargs: str) -> hub.HubRefusal:
    with pytest.raises(hub.HubRefusal) as caught:
        hub.inspect(endpoint=served.url, repo_id=repo_id, **kwargs)
    return caught.value


def test_a_repository_or_revision_that_does_not_exist_is_refused_for_its_field(
        served: Hub, demo: Path) -> None:
    served.publish("kvrun/demo", demo)

    missing = refusal(served, "kvrun/nothing-here")
    assert missing.field == "hf_repo"
    assert missing.message.startswith("No repository kvrun/nothing-here on the hub, or it is "
                                      "private")
    revision = refusal(served, "kvrun/demo", revision="v9")
    assert revision.field == "hf_revision"
    assert revision.message == ("kvrun/demo has no branch, tag or commit 'v9': check the "
                                "revision on its hub page.")
    assert refusal(served, "not a hub id").message.startswith("'not a hub id' is not a hub id")


def test_gated_and_private_repositories_say_what_the_token_lacks(served: Hub, demo: Path) -> None:
    served.publish("kvrun/gated", demo, gated=True, readers=(READER,))
    served.publish("kvrun/private", demo, private=True, readers=(READER,))
    served.tokens.add(STRANGER)

    no_token = refusal(served, "kvrun/gated")
    assert (no_token.field, no_token.message) == ("hf_token", (
        "kvrun/gated is gated: request access on its hub page, then add an access token of an "
        "account that has been granted it."))
    assert refusal(served, "kvrun/gated", token=STRANGER).message.startswith(
        "This access token has not been granted kvrun/gated")
    assert hub.inspect(endpoint=served.url, repo_id="kvrun/gated", token=READER).commit

    assert refusal(served, "kvrun/private").message.startswith(
        "No repository kvrun/private on the hub, or it is private")
    assert refusal(served, "kvrun/private", token=STRANGER).message.startswith(
        "No repository kvrun/private that this access token can read")
    assert hub.inspect(endpoint=served.url, repo_id="kvrun/private", token=READER).commit

    invalid = refusal(served, "kvrun/demo", token="hf_made_up")
    assert (invalid.field, invalid.message) == ("hf_token", (
        "The hub refused this access token (invalid or expired): make a new read token and "
        "try again."))


def test_a_repository_without_safetensors_or_config_is_refused(served: Hub,
                                                               tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (pickled / "pytorch_model.bin").write_bytes(b"\0" * 100)
    served.publish("kvrun/pickled", pickled)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "README.md").write_text("weights elsewhere")
    served.publish("kvrun/bare", bare)

    assert "has no safetensors weights at" in refusal(served, "kvrun/pickled").message
    assert "has no config.json" in refusal(served, "kvrun/bare").message


def test_a_hub_that_cannot_be_reached_is_said_so() -> None:
    with pytest.raises(hub.HubRefusal, match="could not be reached"):
        hub.inspect(endpoint="http://127.0.0.1:9", repo_id="kvrun/demo")
