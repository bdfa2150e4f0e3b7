from engine.metrics import engine_token_totals, totals

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
