import pytest

from engine.offload_check import judge, tier_counters

NATIVE_BEFORE = {"vllm:kv_offload_store_bytes_total": 0.0,
                 "vllm:kv_offload_load_bytes_total": 0.0}


def test_the_tier_s_counters_are_read_from_the_engine_s_metrics() -> None:
    text = ('vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 1048576.0\n'
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 4096.0\n')

    assert tier_counters(text) == {"vllm:kv_offload_store_bytes_total": 1048576.0,
                                   "vllm:external_prefix_cache_hits_total": 256.0}


def test_a_tier_that_stores_and_a_faster_repeat_pass() -> None:
    stored = {**NATIVE_BEFORE, "vllm:kv_offload_store_bytes_total": 64 * 2**20}

    verdict = judge(before=NATIVE_BEFORE, after_first=stored, after_second=stored,
                    first_seconds=0.8, second_seconds=0.1, disk_tier=False)

    assert verdict.works
    assert verdict.message == ("KV tier self-test passed: 64.0 MiB stored, the repeat 0.10 s "
                               "against 0.80 s.")


@pytest.mark.parametrize(("after_first", "after_second", "disk_tier", "seconds", "cause"), [
    ({}, {}, False, (0.8, 0.1), "(version mapping)"),
    (NATIVE_BEFORE, NATIVE_BEFORE, False, (0.8, 0.1), "its pool may be too small"),
    ({**NATIVE_BEFORE, "vllm:kv_offload_allocation_failure_total": 3.0},
     {**NATIVE_BEFORE, "vllm:kv_offload_allocation_failure_total": 3.0}, False, (0.8, 0.1),
     "refused 3 allocation(s)"),
    ({"vllm:external_prefix_cache_hits_total": 0.0, "lmcache:num_stored_tokens": 4096.0},
     {"vllm:external_prefix_cache_hits_total": 0.0, "lmcache:num_stored_tokens": 4096.0},
     True, (0.8, 0.1), "(PYTHONHASHSEED)"),
    ({**NATIVE_BEFORE, "vllm:kv_offload_store_bytes_total": 2**20},
     {**NATIVE_BEFORE, "vllm:kv_offload_store_bytes_total": 2**20}, False, (0.5, 0.6),
     "no faster than the first"),
])
def test_a_tier_that_does_nothing_is_named_with_its_likely_cause(
        after_first: dict, after_second: dict, disk_tier: bool, seconds: tuple, cause: str
) -> None:
    verdict = judge(before={}, after_first=after_first, after_second=after_second,
                    first_seconds=seconds[0], second_seconds=seconds[1], disk_tier=disk_tier)

    assert not verdict.works
    assert cause in verdict.message
