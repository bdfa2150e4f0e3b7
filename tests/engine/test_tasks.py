import pytest

from engine import tasks


@pytest.mark.parametrize(("config", "task"), [
    ({"architectures": ["BertModel"]}, tasks.EMBED),
    ({"architectures": ["XLMRobertaModel"]}, tasks.EMBED),
    ({"architectures": ["XLMRobertaForSequenceClassification"], "id2label": {"0": "LABEL_0"}},
     tasks.SCORE),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}, tasks.SCORE),
    # A classifier of several labels is neither a reranker nor anything kvrun serves.
    ({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "1": "b"}},
     tasks.UNSERVED),
    # Qwen3-Embedding's checkpoint names a generative architecture: a person says it embeds.
    ({"architectures": ["Qwen3ForCausalLM"]}, tasks.GENERATE),
    ({}, tasks.GENERATE),
])
def test_a_checkpoint_s_task_is_read_from_its_architecture(config: dict, task: str) -> None:
    assert tasks.detected(config) == task


def test_pooling_engines_run_the_pooling_runner_and_convert_a_generative_checkpoint() -> None:
    assert tasks.runner_args(tasks.GENERATE, architecture="LlamaForCausalLM") == []
    assert tasks.runner_args(tasks.EMBED, architecture="BertModel") == ["--runner", "pooling"]
    assert tasks.runner_args(tasks.EMBED, architecture="Qwen3ForCausalLM") == [
        "--runner", "pooling", "--convert", "embed"]
    assert tasks.runner_args(tasks.SCORE, architecture="XLMRobertaForSequenceClassification"
                             ) == ["--runner", "pooling"]


def test_encoders_keep_no_kv_cache_and_decoders_do() -> None:
    assert not tasks.keeps_kv_cache("BertModel")
    assert not tasks.keeps_kv_cache("XLMRobertaForSequenceClassification")
    assert tasks.keeps_kv_cache("Qwen3ForCausalLM")
    assert tasks.keeps_kv_cache("LlamaForSequenceClassification")
