import json
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from endpoints.models import GPUType, ModelSpec
from endpoints.planning import shape_of
from endpoints.selectors import gpu_type_for_device
from endpoints.services import CATALOG_DIR, do_load_catalogs
from engine.parsers import MARKERS, REASONING_PARSERS, TOOL_CALL_PARSERS
from engine.sizing import kv_bytes_per_token

pytestmark = pytest.mark.django_db


@pytest.fixture
def catalogs(db: None) -> None:
    do_load_catalogs()


def test_loading_twice_updates_in_place(catalogs: None) -> None:
    ModelSpec.objects.filter(slug="llama-3.1-8b-instruct").update(layers=1)

    models, gpus = do_load_catalogs()

    assert models == ModelSpec.objects.count() >= 16  # 15 popular open models and the demo
    assert gpus == GPUType.objects.count() == 10
    assert ModelSpec.objects.get(slug="llama-3.1-8b-instruct").layers == 32


def test_the_catalog_has_the_models_users_ask_for(catalogs: None) -> None:
    slugs = set(ModelSpec.objects.values_list("slug", flat=True))

    assert {"llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "llama-3.1-405b-instruct",
            "llama-3.3-70b-instruct", "qwen2.5-7b-instruct", "qwen2.5-72b-instruct", "qwen3-8b",
            "mistral-7b-instruct-v0.3", "mixtral-8x7b-instruct-v0.1", "gemma-2-9b-it",
            "gemma-2-27b-it", "phi-3-mini-4k-instruct", "deepseek-v3",
            "kvrun-demo-tiny"} <= slugs


def test_catalog_rows_are_consistent() -> None:
    for row in json.loads((CATALOG_DIR / "models.json").read_text()):
        if row["attention_kind"] == "mla":
            assert row["kv_lora_rank"] and row["qk_rope_head_dim"], row["slug"]
        else:
            assert row["attention_heads"] % row["kv_heads"] == 0, row["slug"]
        # Embedding and reranking models read passages, not conversations.
        assert row["max_context"] >= (2048 if row["task"] == "generate" else 512), row["slug"]
        assert "--" not in row["slug"], "'--' names an organisation's own models"


def test_each_catalog_model_s_parsers_are_its_family_s_or_none() -> None:
    """What a model added by the same id would get (engine.parsers), or none where its
    family's does not fit it (Mixtral v0.1's tokenizer has no [TOOL_CALLS])."""
    chosen = {row["slug"]: (row["tool_call_parser"], row["reasoning_parser"])
              for row in json.loads((CATALOG_DIR / "models.json").read_text())}
    for row in json.loads((CATALOG_DIR / "models.json").read_text()):
        tools = TOOL_CALL_PARSERS.get(row["architecture"])
        reasoning = REASONING_PARSERS.get(row["architecture"])
        assert row["tool_call_parser"] in ("", *MARKERS), row["slug"]
        assert row["reasoning_parser"] in ("", *MARKERS), row["slug"]
        if row["tool_call_parser"]:
            assert tools is not None, row["slug"]
        if row["reasoning_parser"]:
            assert reasoning is not None and reasoning("enable_thinking") == row[
                "reasoning_parser"], row["slug"]
    assert chosen["llama-3.1-8b-instruct"] == ("llama3_json", "")
    assert chosen["qwen3-8b"] == ("hermes", "qwen3")
    assert chosen["mixtral-8x7b-instruct-v0.1"] == ("", "")


def test_the_api_lists_filters_and_fetches_models(owner_api: APIClient, catalogs: None) -> None:
    llama = owner_api.get("/api/v1/models/", {"family": "llama"}).json()["results"]
    one = owner_api.get("/api/v1/models/llama-3.1-70b-instruct/").json()

    assert {m["slug"] for m in llama} >= {"llama-3.1-8b-instruct", "llama-3.3-70b-instruct"}
    assert (one["layers"], one["kv_heads"], one["head_dim"]) == (80, 8, 128)
    assert APIClient().get("/api/v1/models/").status_code in (401, 403)


def test_the_api_lists_gpu_types_by_price(owner_api: APIClient, catalogs: None) -> None:
    gpus = owner_api.get("/api/v1/gpu-types/").json()["results"]

    prices = [Decimal(g["hourly_price_usd"]) for g in gpus]
    assert prices == sorted(prices)
    h200 = next(g for g in gpus if g["slug"] == "h200")
    assert h200["memory_gib"] == 140.4


@pytest.mark.parametrize(
    ("name", "mib", "slug"),
    [("NVIDIA H200", 143771, "h200"), ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
     ("NVIDIA A100-PCIE-40GB", 40536, "a100-40gb"), ("NVIDIA L4", 23034, "l4")],
)
def test_a_device_maps_to_its_catalog_type(catalogs: None, name: str, mib: int, slug: str) -> None:
    assert gpu_type_for_device(device_name=name, memory_bytes=mib * 2**20).slug == slug


# 2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16), worked out by hand from each
# model's config.json; MLA (DeepSeek-V3) stores layers x (latent rank + rope dim) x 2 bytes.
KV_BYTES_PER_TOKEN = {
    "kvrun-demo-tiny": 2 * 2 * 1 * 64 * 2,
    "kvrun-bench-prefill": 2 * 6 * 2 * 64 * 2,
    "llama-3.1-8b-instruct": 131_072,
    "llama-3.1-70b-instruct": 327_680,
    "llama-3.1-405b-instruct": 516_096,
    "llama-3.3-70b-instruct": 327_680,
    "llama-3.2-3b-instruct": 114_688,
    "qwen2.5-7b-instruct": 57_344,
    "qwen2.5-32b-instruct": 262_144,
    "qwen2.5-72b-instruct": 327_680,
    "qwen3-8b": 147_456,
    "mistral-7b-instruct-v0.3": 131_072,
    "mistral-nemo-instruct-2407": 163_840,
    "mixtral-8x7b-instruct-v0.1": 131_072,
    "gemma-2-9b-it": 344_064,
    "gemma-2-27b-it": 376_832,
    "phi-3-mini-4k-instruct": 393_216,
    "deepseek-v3": 61 * (512 + 64) * 2,
    "kvrun-demo-embed": 2 * 2 * 1 * 64 * 2,
    "kvrun-demo-rerank": 2 * 2 * 1 * 64 * 2,
    "qwen3-embedding-0.6b": 114_688,
}


def test_every_catalog_model_needs_the_kv_bytes_worked_out_by_hand(catalogs: None) -> None:
    # Encoders (BGE's) keep no KV cache.
    computed = {model.slug: kv_bytes_per_token(shape_of(model))
                for model in ModelSpec.objects.all() if shape_of(model).kv_cache}

    assert computed == KV_BYTES_PER_TOKEN
