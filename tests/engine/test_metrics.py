import pytest

from engine.metrics import engine_token_totals, quantile, snapshot, totals

SAMPLE = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="chat"} 120.0
vllm:generation_tokens_total{engine="0",model_name="chat"} 37.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="chat"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="chat"} 8.0
vllm:num_requests_running{engine="0",model_name="chat"} 0.0
"""


def test_it_sums_each_metric_over_its_labels() -> None:
    found = totals(SAMPLE)

    assert found["vllm:request_success_total"] == 10.0
    assert found["vllm:num_requests_running"] == 0.0


def test_it_reads_the_engine_s_token_counters() -> None:
    assert engine_token_totals(SAMPLE) == {"prompt": 120.0, "generation": 37.0}
    assert engine_token_totals("") == {"prompt": 0.0, "generation": 0.0}


ENGINE = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="chat"} 0.25
vllm:num_requests_running{engine="0",model_name="chat"} 3.0
vllm:num_requests_waiting{engine="0",model_name="chat"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="chat"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="chat"} 640.0
vllm:num_preemptions_total{engine="0",model_name="chat"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="chat"} 1000.0
vllm:generation_tokens_total{engine="0",model_name="chat"} 300.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="chat"} 9.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="chat"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="chat"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="chat"} 9.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="chat"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="chat"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="chat"} 290.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="chat"} 290.0
"""


def test_a_snapshot_holds_the_gauges_counters_and_buckets_kvrun_charts() -> None:
    shot = snapshot(ENGINE)

    assert (shot.kv_cache_usage, shot.running, shot.waiting) == (0.25, 3, 1)
    assert (shot.prefix_queries, shot.prefix_hits, shot.preemptions) == (1000, 640, 2)
    assert (shot.prompt_tokens, shot.generation_tokens, shot.requests) == (1000, 300, 10)
    assert shot.external_queries is None and shot.external_hits is None  # no connector
    assert shot.ttft_buckets == {"0.1": 4.0, "0.5": 9.0, "+Inf": 10.0}
    assert shot.itl_buckets == {"0.01": 290.0, "+Inf": 290.0}


def test_a_connector_s_counters_are_read_where_the_engine_has_them() -> None:
    shot = snapshot(ENGINE + 'vllm:external_prefix_cache_queries_total{engine="0"} 512.0\n'
                             'vllm:external_prefix_cache_hits_total{engine="0"} 256.0\n')

    assert (shot.external_queries, shot.external_hits) == (512, 256)


def test_quantiles_interpolate_within_their_bucket_as_prometheus_does() -> None:
    counts = {"0.1": 4.0, "0.5": 9.0, "+Inf": 10.0}

    assert quantile(0.5, counts) == pytest.approx(0.1 + 0.4 * (5 - 4) / (9 - 4))
    assert quantile(0.2, counts) == pytest.approx(0.1 * 2 / 4)
    assert quantile(0.95, counts) == 0.5  # in the +Inf bucket: the highest finite bound
    assert quantile(0.5, {"0.1": 0.0, "+Inf": 0.0}) is None
    assert quantile(0.5, {}) is None


@pytest.mark.parametrize("line", [
    'vllm:num_requests_running{engine="0"} +Inf',
    'vllm:num_requests_waiting{engine="1"} -5',
    'vllm:prompt_tokens_total{engine="0"} 1e400',
    'vllm:prefix_cache_hits_total{engine="0"} NaN',
    'vllm:kv_cache_usage_perc{engine="0"} 1.5',
    'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} NaN',
])
def test_a_value_that_cannot_be_a_reading_is_refused_not_stored(line: str) -> None:
    # The node agent leaves that engine out of the scrape (and does not wait on it while
    # draining); a value the database would refuse would lose the node's whole batch.
    with pytest.raises(ValueError, match="not a"):
        snapshot(ENGINE + line + "\n")
