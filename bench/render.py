"""`make docs`: render docs/benchmarks.md from bench/results/*.json, the only place figures
are written; each target's method comes from its module's docstring. A document that shows a
target's figures beside its own words holds them between two markers, and the same table is
rendered there.

    python -m bench.render            # write docs/benchmarks.md
    python -m bench.render --check    # exit 1 when it differs from what the results say

Standard library only, and no benchmark module is imported (they set Django up on import).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from bench.record import RESULTS, ROOT, bound, shown_value

# The targets `make bench` runs, in this order (kvrun.launcher reads it).
BENCHMARKS = ("provision", "gateway", "dashboard", "billing", "kv", "autoscale", "models")
DOCUMENT = ROOT / "docs" / "benchmarks.md"
# The documents that show a target's table in the place of their markers.
EMBEDDED = {ROOT / "docs" / "kv-and-autoscaling.md": "kv"}

INTRO = """# Benchmarks

`make bench` runs the seven targets on the machine it is given, each against an empty database
(`make bench BENCH=billing` runs one), writes what each measured to `bench/results/<target>.json`
and renders this page from those files (`make docs` renders it alone). Nothing here is typed:
a test fails when this page differs from the results. Each target compares kvrun with a floor
measured side by side in the same run (a bare engine, a direct request, a plain query), so
that its goals are ratios that hold from one machine to another; an absolute goal, which
depends on the machine and its day, is marked as such and fails no run.
"""


def render(results: Path = RESULTS, benchmarks: Path = ROOT / "bench") -> str:
    parts = [INTRO]
    for name in BENCHMARKS:
        path = results / f"{name}.json"
        if path.exists():
            parts.append(_section(name, json.loads(path.read_text()),
                                  _method(benchmarks / f"{name}.py")))
    return "\n".join(parts)


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- the {name} benchmark's figures, rendered by `make docs` -->",
            f"<!-- end of the {name} benchmark's figures -->")


def documents(results: Path = RESULTS, benchmarks: Path = ROOT / "bench") -> dict[Path, str]:
    """Each rendered document by its path: the benchmark page, and each document that shows a
    target's figures with its table rendered between its markers."""
    rendered = {DOCUMENT: render(results, benchmarks)}
    for path, name in EMBEDDED.items():
        begin, end = markers(name)
        text = path.read_text()
        head, found, rest = text.partition(begin)
        if not found or end not in rest:
            raise ValueError(f"{path.name} lacks the markers of the {name} benchmark's figures")
        table = _section(name, json.loads((results / f"{name}.json").read_text()), method=None)
        rendered[path] = f"{head}{begin}\n{table}{end}{rest.partition(end)[2]}"
    return rendered


def _method(module: Path) -> str:
    return ast.get_docstring(ast.parse(module.read_text())) or ""


def _section(name: str, result: dict, method: str | None) -> str:
    """The target's heading, method and table; the table alone without a method."""
    machine = result["machine"]
    lines = [f"## {name}", "", "```text", method, "```", ""] if method is not None else []
    lines += [f"Measured {result['measured_at']} on {machine['cores']} cores, "
             f"{machine['memory_gib']} GiB, {machine['cpu']}, at commit `{result['commit']}`.",
             "", "| figure | value | goal | met |", "| --- | ---: | --- | --- |"]
    for goal in result["goals"]:
        met = ("yes" if goal["met"] else "**no**") if goal.get("required", True) else (
            "yes" if goal["met"] else "no") + " (depends on the machine)"
        lines.append(f"| {goal['label']} | {shown_value(result[goal['key']], goal['unit'])} | "
                     f"{bound(goal)} | {met} |")
    for figure in result.get("shown", []):
        lines.append(f"| {figure['label']} | {shown_value(result[figure['key']], figure['unit'])} "
                     "| | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    rendered = documents()
    if "--check" in argv:
        return 0 if all(path.exists() and path.read_text() == text
                        for path, text in rendered.items()) else 1
    for path, text in rendered.items():
        path.write_text(text)
        print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
