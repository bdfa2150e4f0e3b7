"""The gateway's memory of keys and routes, on its own event loop in this process."""

import asyncio
from collections import Counter
from typing import Any

import pytest

from accounts.models import Organization
from gateway import directory
from tests.factories import inference_key, ready_endpoint

pytestmark = pytest.mark.django_db(transaction=True)  # read on Django's own thread


def test_concurrent_misses_read_the_database_once_and_share_what_it_said(
        org: Organization, monkeypatch: pytest.MonkeyPatch) -> None:
    ready_endpoint(org, "chat", [41000])
    _, secret = inference_key(org)
    reads: Counter[str] = Counter()

    def counting(name: str) -> Any:
        read = getattr(directory, name)

        def counted(*args: Any) -> Any:
            reads[name] += 1
            return read(*args)
        return counted

    for name in ("_read_key", "_read_endpoints"):
        monkeypatch.setattr(directory, name, counting(name))
    memory = directory.Directory(key_seconds=60, route_seconds=60)

    async def at_once() -> list[Any]:
        # Each request starts before any read has come back, as a burst reaches a gateway
        # whose cache has just expired.
        return await asyncio.gather(*(memory.identity(secret) for _ in range(20)),
                                    *(memory.routes(org.id) for _ in range(20)))

    answers = asyncio.run(at_once())

    assert reads == {"_read_key": 1, "_read_endpoints": 1}
    identities, routes = answers[:20], answers[20:]
    assert {identity.organization_id for identity in identities} == {org.id}
    assert all(list(found) == ["chat"] for found in routes)
