import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT, RestartableRedis

FIGURES = ROOT / "artifacts" / "faults"


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    """figures(**counts): keep what a fault test measured (requests sent, records stored,
    orphans, 5xx) in artifacts/faults/<test>.json, for the README's table."""
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
