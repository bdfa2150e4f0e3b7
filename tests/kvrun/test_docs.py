"""The documents stay true: every setting is documented, and the benchmark page says what
the results files say."""

import json
import re

from bench.render import documents, render
from tests.helpers import ROOT


def test_every_figure_in_the_documents_is_rendered_from_the_results() -> None:
    rendered = documents()

    assert len(rendered) == 2  # the benchmark page, and the kv figures in the KV document
    for path, text in rendered.items():
        assert path.read_text() == text, (
            f"{path.name} differs from bench/results/*.json: run `make docs`")


def test_the_benchmark_page_shows_each_goal_with_its_figure_and_verdict(tmp_path) -> None:
    (tmp_path / "billing.json").write_text(json.dumps({
        "measured_at": "2026-12-06 03:00 UTC", "commit": "abc123",
        "machine": {"cores": 2, "memory_gib": 23.5, "cpu": "a CPU"},
        "ratio": 2.5, "rate": 1234567, "seconds": 0.123456,
        "goals": [{"key": "ratio", "label": "the ratio", "at_most": 2.2, "below": None,
                   "at_least": None, "unit": "", "required": True, "met": False},
                  {"key": "rate", "label": "the rate", "at_most": None, "below": None,
                   "at_least": 500000, "unit": "records/s", "required": False, "met": True}],
        "shown": [{"key": "seconds", "label": "the time", "unit": "s"}]}))

    page = render(results=tmp_path, benchmarks=ROOT / "bench")

    assert "## billing" in page and "## gateway" not in page  # only what has results
    assert "Measured 2026-12-06 03:00 UTC on 2 cores, 23.5 GiB, a CPU, at commit `abc123`." in page
    assert "| the ratio | 2.5 | ≤ 2.2 | **no** |" in page
    assert ("| the rate | 1,234,567 records/s | ≥ 500,000 records/s "
            "| yes (depends on the machine) |") in page
    assert "| the time | 0.1235 s | | |" in page


def test_the_configuration_documents_every_environment_variable() -> None:
    sources = [ROOT / "kvrun" / "settings.py", ROOT / "kvrun" / "launcher.py",
               ROOT / "engine" / "devices.py"]
    used = set()
    for path in sources:
        text = path.read_text()
        used |= set(re.findall(r'env\.\w+\(\s*"([A-Z_]+)"', text))
        used |= set(re.findall(r'env(?:iron)?\.get\(\s*"([A-Z_]+)"', text))
        used |= set(re.findall(r'environ\[\s*"([A-Z_]+)"\]', text))
    used -= {"DJANGO_SETTINGS_MODULE", "XDG_RUNTIME_DIR"}
    documented = (ROOT / "docs" / "configuration.md").read_text()

    assert used, "found no variables: the pattern is wrong"
    missing = sorted(name for name in used if f"`{name}`" not in documented)
    assert not missing, f"docs/configuration.md's table lacks {missing}"
