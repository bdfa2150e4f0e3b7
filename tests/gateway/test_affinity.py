from collections import Counter

from engine.tls import EngineAddress
from gateway.affinity import PREFIX_CHARACTERS, Ring, leading_prompt, prefix_key
from gateway.directory import Upstream


def upstreams(count: int) -> list[Upstream]:
    return [Upstream(replica_id=f"replica-{n}",
                     address=EngineAddress(host=f"10.0.0.{n}", port=8000, api_key=""))
            for n in range(count)]


def keys(count: int) -> list[int]:
    return [prefix_key({"prompt": f"document {n} " * 10}, salt="org") for n in range(count)]


def test_the_leading_prompt_is_the_messages_roles_and_texts_cut_at_the_limit() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}

    assert leading_prompt(chat) == b"system\x1fBe brief.\x1fuser\x1fHi"
    assert leading_prompt({"prompt": "x" * 5000}) == b"x" * PREFIX_CHARACTERS
    assert leading_prompt({"prompt": [[1, 2, 3]]}) == b"1,2,3"  # token ids, first of a batch
    assert leading_prompt({"prompt": ["first", "second"]}) == b"first"
    assert leading_prompt({"messages": []}) == b""


def test_prompts_that_part_past_the_limit_share_a_key_and_salts_keep_tenants_apart() -> None:
    shared = "The same long document. " * 50

    first = prefix_key({"prompt": shared + "Question one?"}, salt="org-a")
    second = prefix_key({"prompt": shared + "Another question?"}, salt="org-a")
    elsewhere = prefix_key({"prompt": shared + "Question one?"}, salt="org-b")

    assert first == second != elsewhere
    assert prefix_key({"prompt": "short one"}, salt="org-a") != prefix_key(
        {"prompt": "short two"}, salt="org-a")
    assert prefix_key({"messages": []}, salt="org-a") is None


def test_each_replica_owns_an_even_share_of_the_keys() -> None:
    pool = upstreams(4)
    ring = Ring.of(pool)

    owners = Counter(ring.choose(key, upstreams=pool, tried=set(), concurrency=10**6).replica_id
                     for key in keys(4000))

    assert set(owners) == {upstream.replica_id for upstream in pool}
    assert all(600 <= count <= 1400 for count in owners.values()), owners


def test_a_replica_that_leaves_moves_only_its_own_keys() -> None:
    pool = upstreams(3)
    before = Ring.of(pool)
    after = Ring.of(pool[:2])

    moved = [key for key in keys(1000)
             if (owner := before.choose(key, upstreams=pool, tried=set(), concurrency=99)) is not
             pool[2] and after.choose(key, upstreams=pool[:2], tried=set(),
                                      concurrency=99) is not owner]

    assert moved == []


def test_a_replica_past_its_load_bound_or_concurrency_passes_the_key_on() -> None:
    pool = upstreams(2)
    ring = Ring.of(pool)
    key = keys(1)[0]
    owner = ring.choose(key, upstreams=pool, tried=set(), concurrency=8)
    other = next(upstream for upstream in pool if upstream is not owner)

    owner.in_flight = 2  # bound: ceil(1.25 × (2 + 0 + 1) / 2) = 2
    assert ring.choose(key, upstreams=pool, tried=set(), concurrency=8) is other

    owner.in_flight, other.in_flight = 3, 3  # bound ceil(1.25 × 7 / 2) = 5, concurrency 3
    assert ring.choose(key, upstreams=pool, tried=set(), concurrency=3) is None

    owner.in_flight, other.in_flight = 0, 0
    assert ring.choose(key, upstreams=pool, tried={owner}, concurrency=8) is other
    assert Ring.of([]).choose(key, upstreams=[], tried=set(), concurrency=8) is None
