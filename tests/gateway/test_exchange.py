"""What the gateway keeps of the usage an engine reports: an engine runs weights its tenant
chose, so a count it could not have used never reaches the ledger."""

import pytest

from billing.usage_stream import MOST_TOKENS
from gateway.exchange import Exchange
from gateway.protocol import sequences


def exchange(most_tokens: int = 2048) -> Exchange:
    return Exchange(request_id="req_test", operation="completions", started_ms=0,
                    most_tokens=most_tokens)


def test_usage_an_engine_could_have_used_is_kept() -> None:
    taken = exchange()
    taken.take_usage({"prompt_tokens": 700, "completion_tokens": 90,
                      "prompt_tokens_details": {"cached_tokens": 640}})

    assert (taken.prompt_tokens, taken.completion_tokens, taken.cached_tokens) == (700, 90, 640)


@pytest.mark.parametrize(("usage", "kept"), [
    ({"prompt_tokens": -3, "completion_tokens": -1}, (0, 0, 0)),
    ({"prompt_tokens": 10**12, "completion_tokens": 2049}, (2048, 2048, 0)),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}, (10, 0, 10)),
    ({"prompt_tokens": "7", "completion_tokens": 2.5, "prompt_tokens_details": [3]}, (0, 0, 0)),
    ({"prompt_tokens": True, "completion_tokens": None}, (0, 0, 0)),
])
def test_usage_an_engine_could_not_have_used_is_bounded(usage: dict, kept: tuple) -> None:
    taken = exchange()
    taken.take_usage(usage)

    assert (taken.prompt_tokens, taken.completion_tokens, taken.cached_tokens) == kept


def test_usage_that_is_not_an_object_is_ignored() -> None:
    taken = exchange()
    taken.take_usage([1, 2, 3])

    assert not taken.usage_seen and taken.prompt_tokens == 0


def test_no_count_outgrows_the_ledger() -> None:
    assert exchange(most_tokens=MOST_TOKENS).counted(2**40) == MOST_TOKENS


@pytest.mark.parametrize(("payload", "count"), [
    ({"prompt": "one"}, 1),
    ({"prompt": [1, 2, 3]}, 1),  # one prompt, as token ids
    ({"prompt": ["a", "b", "c"], "n": 2}, 6),
    ({"prompt": [[1, 2], [3]]}, 2),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 4}, 4),
    ({"prompt": "one", "n": 0}, 1),
    ({"prompt": "one", "n": "3"}, 1),
])
def test_a_request_s_sequences(payload: dict, count: int) -> None:
    assert sequences(payload) == count
