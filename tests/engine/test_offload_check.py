import pytest

from engine.offload_check import judge, tier_counters

NATIVE_BEFORE = {"vllm:kv_offload_store_bytes_total": 0.0,
                 "vllm:kv_offload_load_bytes_total": 0.0}
NATIVE_STORED = {**NATIVE_BEFORE, "vllm:kv_offload_store_bytes_total": 64 * 2**20}
LMCACHE_BEFORE = {"vllm:external_prefix_cache_queries_total": 0.0,
                  "vllm:external_prefix_cache_hits_total": 0.0}
LMCACHE_ASKED = {**LMCACHE_BEFORE, "vllm:external_prefix_cache_queries_total": 4096.0}


def test_the_tier_s_counters_are_read_from_the_engine_s_metrics() -> None:
    text = ('vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 1048576.0\n'
            'vllm:kv_offload_store_bytes_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:kv_offload_cpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 4096.0\n')

    assert tier_counters(text) == {"vllm:kv_offload_store_bytes_total": 1048576.0,
                                   "vllm:external_prefix_cache_hits_total": 256.0}


def test_a_tier_that_stores_and_a_faster_repeat_pass() -> None:
    verdict = judge(before=NATIVE_BEFORE, after_first=NATIVE_STORED, after_second=NATIVE_STORED,
                    first_seconds=0.8, second_seconds=0.1, disk_tier=False, prefix_caching=True)

    assert verdict.works
    assert verdict.message == (
        "KV tier self-test passed: 64.0 MiB stored, the repeat 0.10 s against 0.80 s; the "
        "device's prefix cache served the repeat, so the tier gives KV back only once the "
        "device has evicted it.")


def test_without_prefix_caching_the_repeat_comes_back_from_the_tier() -> None:
    returned = {**LMCACHE_ASKED, "vllm:external_prefix_cache_hits_total": 3840.0,
                "vllm:external_prefix_cache_queries_total": 8192.0}

    verdict = judge(before=LMCACHE_BEFORE, after_first=LMCACHE_ASKED, after_second=returned,
                    first_seconds=0.8, second_seconds=0.2, disk_tier=True, prefix_caching=False)

    assert verdict.works
    assert verdict.figures["returned"] == 3840.0
    assert verdict.message.endswith("; the tier gave back 3,840 tokens.")


def test_lmcache_is_judged_by_its_connector_s_lookups_when_the_device_serves_the_repeat(
) -> None:
    verdict = judge(before=LMCACHE_BEFORE, after_first=LMCACHE_ASKED, after_second=LMCACHE_ASKED,
                    first_seconds=0.8, second_seconds=0.1, disk_tier=True, prefix_caching=True)

    assert verdict.works
    assert "4,096 tokens looked up in LMCache" in verdict.message


@pytest.mark.parametrize(
    ("after_first", "after_second", "disk_tier", "prefix_caching", "seconds", "cause"), [
        ({}, {}, False, True, (0.8, 0.1), "(version mapping)"),
        (LMCACHE_BEFORE, LMCACHE_BEFORE, True, True, (0.8, 0.1), "never asked its LMCache"),
        (NATIVE_BEFORE, NATIVE_BEFORE, False, True, (0.8, 0.1), "its pool may be too small"),
        ({**NATIVE_STORED, "vllm:kv_offload_allocation_failure_total": 3.0},
         {**NATIVE_STORED, "vllm:kv_offload_allocation_failure_total": 3.0}, False, True,
         (0.8, 0.1), "refused 3 allocation(s)"),
        (LMCACHE_ASKED, {**LMCACHE_ASKED, "vllm:external_prefix_cache_queries_total": 8192.0},
         True, False, (0.8, 0.1), "(PYTHONHASHSEED)"),
        (NATIVE_STORED, NATIVE_STORED, False, True, (0.5, 0.6), "no faster than the first"),
    ])
def test_a_tier_that_does_nothing_is_named_with_its_likely_cause(
        after_first: dict, after_second: dict, disk_tier: bool, prefix_caching: bool,
        seconds: tuple, cause: str) -> None:
    verdict = judge(before={}, after_first=after_first, after_second=after_second,
                    first_seconds=seconds[0], second_seconds=seconds[1], disk_tier=disk_tier,
                    prefix_caching=prefix_caching)

    assert not verdict.works
    assert cause in verdict.message
