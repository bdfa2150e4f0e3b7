"""`.ci/run` fails when a test fails and when no test runs."""

import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.helpers import ROOT


def run_ci(pytest_args: str) -> subprocess.CompletedProcess:
    # A database of its own, so the inner run's test database does not collide with ours.
    url = urlsplit(os.environ["DATABASE_URL"])
    env = {**os.environ, "PYTEST_ARGS": pytest_args,
           "DATABASE_URL": urlunsplit(url._replace(path="/kvrun_ci"))}
    return subprocess.run(["bash", ".ci/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.e2e
def test_ci_fails_when_a_test_fails(tmp_path: Path) -> None:
    failing = tmp_path / "test_failing.py"
    failing.write_text("def test_it_fails():\n    assert 1 + 1 == 3\n")

    result = run_ci(f"-p no:cacheprovider {failing}")

    assert result.returncode != 0
    assert "1 failed" in result.stdout


@pytest.mark.e2e
def test_ci_fails_when_no_test_runs() -> None:
    result = run_ci("-k no_test_has_this_name tests/engine")

    assert result.returncode != 0
    assert "deselected" in result.stdout
