"""Sizing against figures computed by hand from the models' config.json."""

import dataclasses
from decimal import Decimal

import pytest

from engine.sizing import (
    GIB,
    Accelerator,
    ModelShape,
    Request,
    choose,
    evaluate,
    kv_bytes_for_request,
    kv_bytes_per_token,
    kv_cache_tokens,
    largest_concurrency,
    largest_context,
    request_bytes,
    weight_bytes,
)

LLAMA_70B = ModelShape(name="Llama 3.1 70B", parameters=70_553_706_496, layers=80,
                       attention_heads=64, kv_heads=8, head_dim=128, max_context=131_072)
LLAMA_8B = ModelShape(name="Llama 3.1 8B", parameters=8_030_261_248, layers=32,
                      attention_heads=32, kv_heads=8, head_dim=128, max_context=131_072)
QWEN_7B = ModelShape(name="Qwen2.5 7B", parameters=7_615_616_512, layers=28, attention_heads=28,
                     kv_heads=4, head_dim=128, max_context=32_768)
PHI_3 = ModelShape(name="Phi-3 mini", parameters=3_821_079_552, layers=32, attention_heads=32,
                   kv_heads=32, head_dim=96, max_context=4096, attention_kind="mha")
DEEPSEEK_V3 = ModelShape(name="DeepSeek-V3", parameters=671_026_419_200, layers=61,
                         attention_heads=128, kv_heads=128, head_dim=192, max_context=163_840,
                         attention_kind="mla", kv_lora_rank=512, qk_rope_head_dim=64)
GEMMA_2_9B = ModelShape(name="Gemma 2 9B", parameters=9_241_705_984, layers=42,
                        attention_heads=16, kv_heads=8, head_dim=256, max_context=8192,
                        sliding_window=4096, sliding_window_layers=21)
DEMO = ModelShape(name="demo", parameters=426_624, layers=2, attention_heads=2, kv_heads=1,
                  head_dim=64, max_context=2048)

# Pooling models: BGE small (an encoder, no KV cache) and Qwen3-Embedding 0.6B (a decoder).
BGE_SMALL = ModelShape(name="BGE small", parameters=33_360_000, layers=12, attention_heads=12,
                       kv_heads=12, head_dim=32, max_context=512, attention_kind="mha",
                       pooling=True, kv_cache=False, hidden_size=384, intermediate_size=1536)
QWEN3_EMBEDDING = ModelShape(name="Qwen3 Embedding 0.6B", parameters=595_776_512, layers=28,
                             attention_heads=16, kv_heads=8, head_dim=128, max_context=32_768,
                             pooling=True, hidden_size=1024, intermediate_size=3072)

H200 = Accelerator("h200", "H200", 150_754_820_096, Decimal("5.60"))
H100 = Accelerator("h100-80gb", "H100", 85_520_809_984, Decimal("4.50"))
A100_80 = Accelerator("a100-80gb", "A100 80GB", 85_899_345_920, Decimal("3.20"))
L4 = Accelerator("l4", "L4", 24_152_899_584, Decimal("0.80"))


@pytest.mark.parametrize(
    ("model", "tp", "expected"),
    [
        (LLAMA_70B, 1, 327_680),  # 2 x 80 x 8 x 128 x 2
        (LLAMA_70B, 2, 163_840),
        (LLAMA_70B, 8, 40_960),
        (LLAMA_8B, 1, 131_072),  # 2 x 32 x 8 x 128 x 2
        (QWEN_7B, 1, 57_344),  # 2 x 28 x 4 x 128 x 2
        (QWEN_7B, 8, 14_336),  # 4 KV heads over 8 ranks: one head each, replicated
        (PHI_3, 1, 393_216),  # 2 x 32 x 32 x 96 x 2
        (DEEPSEEK_V3, 1, 70_272),  # 61 x (512 + 64) x 2
        (DEEPSEEK_V3, 8, 70_272),  # MLA's latent is not split by TP
        (GEMMA_2_9B, 1, 344_064),  # 2 x 42 x 8 x 256 x 2, before the window cap
        (DEMO, 1, 512),  # 2 x 2 x 1 x 64 x 2
    ],
)
def test_kv_bytes_per_token(model: ModelShape, tp: int, expected: int) -> None:
    assert kv_bytes_per_token(model, tp=tp) == expected


def test_a_70b_request_of_131072_tokens_needs_40_gib() -> None:
    assert kv_bytes_for_request(LLAMA_70B, tokens=131_072) == 40 * GIB


def test_fp8_kv_halves_the_cache() -> None:
    assert kv_bytes_per_token(LLAMA_70B, kv_dtype="fp8") == 163_840


def test_sliding_window_layers_hold_at_most_the_window() -> None:
    per_layer = 2 * 8 * 256 * 2
    assert kv_bytes_for_request(GEMMA_2_9B, tokens=8192) == per_layer * (21 * 8192 + 21 * 4096)
    assert kv_bytes_for_request(GEMMA_2_9B, tokens=2048) == per_layer * 42 * 2048


def test_requests_take_whole_blocks() -> None:
    assert kv_bytes_for_request(LLAMA_8B, tokens=17) == 131_072 * 32
    assert kv_bytes_for_request(DEMO, tokens=129, block_tokens=128) == 512 * 256


def test_the_demo_pool_matches_what_vllm_logs() -> None:
    # 1 GiB of KV (--kv-cache-memory-bytes) → 1 GiB / 512 B per token.
    assert kv_cache_tokens(DEMO, kv_bytes=GIB) == 2_097_152


def test_weights_by_dtype() -> None:
    assert weight_bytes(LLAMA_70B, "bfloat16") == 141_107_412_992
    assert weight_bytes(LLAMA_70B, "fp8") == 70_553_706_496
    assert weight_bytes(LLAMA_70B, "int4") == 35_276_853_248


def test_weights_as_the_checkpoint_s_files_state_them_win_over_the_dtype() -> None:
    # A 4-bit checkpoint read from the hub: its packed tensors and scales as stored.
    quantized = dataclasses.replace(LLAMA_70B, weights_bytes=39_520_000_000)

    assert weight_bytes(quantized, "bfloat16") == 39_520_000_000


def test_it_chooses_the_cheapest_fit_and_says_why() -> None:
    request = Request(context_length=32_768, concurrency=4)

    decision = choose(LLAMA_70B, request, [H100, H200, A100_80])

    assert (decision.choice.accelerator, decision.choice.count) == (H200, 2)
    assert decision.choice.hourly_price == Decimal("11.20")
    # Per GPU: 0.9 x 150,754,820,096 - 141,107,412,992 / 2 - 2 GiB of runtime.
    assert decision.choice.kv_available_per_gpu == 135_679_338_086 - 70_553_706_496 - 2 * GIB
    assert decision.choice.kv_needed_per_gpu == 4 * 32_768 * 163_840
    assert decision.explanation.startswith(
        "weights 141 GB + KV 40.0 GiB for 4 × 32k tokens → 2 × H200")
    assert "1 × H200 cannot hold the weights" in decision.explanation


def test_a_request_that_fits_nothing_says_what_would_fit() -> None:
    request = Request(context_length=131_072, concurrency=64)

    decision = choose(LLAMA_8B, request, [L4])

    assert decision.choice is None
    assert "fits no offered GPU configuration" in decision.explanation
    # Per GPU of 8: 0.9 x 24,152,899,584 - 16,060,522,496 / 8 - 2 GiB = 17,582,560,665 B;
    # one 128k request at TP 8 (one KV head a rank): 2 x 32 x 1 x 128 x 2 x 131,072 = 2 GiB.
    assert "the largest, 8 × L4, fits 8 × 128k." in decision.explanation


def test_largest_concurrency_and_context() -> None:
    request = Request(context_length=8192, concurrency=1)
    fit = evaluate(LLAMA_8B, request, H100, 1)
    available = int(85_520_809_984 * 0.9) - 8_030_261_248 * 2 - 2 * GIB

    assert largest_concurrency(LLAMA_8B, request, fit) == available // (8192 * 131_072)
    context = largest_context(LLAMA_8B, request, fit, concurrency=4)
    assert 4 * context * 131_072 <= available < 4 * (context + 16) * 131_072


def test_tensor_parallel_sizes_must_divide_the_heads() -> None:
    # 36 x 32k of Qwen2.5 7B: 8 x L4 would hold 37 (0.9 x 24,152,899,584 - 15,231,233,024 / 8
    # - 2 GiB = 17,686,221,849 B a GPU, 32,768 x 14,336 B a request), 4 x L4 only 33; but its
    # 28 attention heads do not split over 8 ranks.
    decision = choose(QWEN_7B, Request(context_length=32_768, concurrency=36), [L4])

    assert decision.choice is None
    assert "the largest, 4 × L4, fits 33 × 32k." in decision.explanation


def test_a_pooling_batch_holds_its_activations_and_a_decoder_s_kv_cache() -> None:
    request = Request(context_length=512, concurrency=64)

    # 2 bytes x (the residual, 384, and the MLP's 2 x 1536, wider than q, k and v's
    # 3 x 12 x 32) a token; an encoder keeps no KV cache.
    assert request_bytes(BGE_SMALL, request, tokens=512, tp=1) == 512 * 2 * (384 + 2 * 1536)
    # 2 x 28 x 8 x 128 x 2 of KV a token, and 2 x (1024 + 2 x 3072) of activations.
    assert request_bytes(QWEN3_EMBEDDING, request, tokens=512, tp=1) == 512 * (
        114_688 + 2 * (1024 + 2 * 3072))

    decision = choose(BGE_SMALL, request, [L4])

    assert decision.choice is not None
    assert decision.choice.kv_needed_per_gpu == 64 * 512 * 6_912
    assert decision.explanation.startswith(
        "weights 66.7 MB + 0.2 GiB for a batch of 64 × 512 tokens → 1 × L4")
