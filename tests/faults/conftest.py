import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from accounts.models import Organization
from tests.factories import inference_key
from tests.helpers import ROOT, RestartableRedis

FIGURES = ROOT / "artifacts" / "faults"


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    """figures(**counts): keep what a fault test measured (requests sent, records stored,
    orphans, 5xx) in artifacts/faults/<test>.json, for the table in docs/testing.md."""
    def keep(**counts: int) -> None:
        FIGURES.mkdir(parents=True, exist_ok=True)
        (FIGURES / f"{request.node.name}.json").write_text(json.dumps(counts, indent=1))
    return keep


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def secret(org: Organization) -> str:
    """A key without per-minute limits: the load in these tests is the fault's, and a fast
    machine would otherwise meet the default 600 requests a minute."""
    return inference_key(org, requests_per_minute=0, tokens_per_minute=0)[1]
