"""Where a benchmark keeps what it measured: `bench/results/<name>.json`, with when, on what
machine and at which commit it was measured, its goals and whether each was met, and the
figures its page shows. `docs/benchmarks.md` is rendered from these files (bench.render),
never typed. Standard library only: the renderer and its test import it without Django.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Figure:
    """A figure of the results (a top-level key) as its page shows it."""

    key: str
    label: str
    unit: str = ""


@dataclass(frozen=True)
class Goal:
    """A bound on one figure. A goal that is not `required` depends on the machine and its
    day (an absolute rate): reported with whether it was met, and no run fails on it."""

    key: str
    label: str
    at_most: float | None = None
    below: float | None = None
    at_least: float | None = None
    unit: str = ""
    required: bool = True

    def met(self, value: float) -> bool:
        return ((self.at_most is None or value <= self.at_most)
                and (self.below is None or value < self.below)
                and (self.at_least is None or value >= self.at_least))


def bound(goal: dict) -> str:
    """A goal (as stored) in words: "≤ 2.2", "≥ 500,000 records/s"."""
    if goal.get("at_least") is True:
        return "yes"
    for key, sign in (("at_most", "≤"), ("below", "<"), ("at_least", "≥")):
        if goal.get(key) is not None:
            return f"{sign} {shown_value(goal[key], goal.get('unit', ''))}"
    return ""


def shown_value(value: object, unit: str = "") -> str:
    """A figure as a person reads it: thousands separated, four significant digits."""
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, list):
        text = ", ".join(str(item) for item in value) or "none"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def print_goals(result: dict, goals: list[Goal]) -> None:
    """Each goal on a line of the benchmark's report, with whether it was met."""
    for goal in goals:
        value = result[goal.key]
        verdict = "met" if goal.met(value) else "NOT MET"
        print(f"  {goal.label:<60} {shown_value(value, goal.unit):>16} "
              f"(goal {bound(asdict(goal))}) {verdict}"
              f"{'' if goal.required else ' (depends on the machine)'}")


def write(name: str, result: dict, *, goals: list[Goal], shown: list[Figure]) -> bool:
    """Store `result` as bench/results/`name`.json with its provenance and goals; returns
    whether every required goal was met."""
    met = {goal.key: goal.met(result[goal.key]) for goal in goals}
    record = {
        "benchmark": name,
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": commit(),
        **result,
        "goals": [asdict(goal) | {"met": met[goal.key]} for goal in goals],
        "shown": [asdict(figure) for figure in shown],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return all(met[goal.key] for goal in goals if goal.required)


def machine() -> dict:
    """Cores, memory and CPU model of this machine."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text()
                   .splitlines() if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        kib = 0
    return {"cores": os.cpu_count() or 0, "memory_gib": round(kib / 1024**2, 1),
            "cpu": model}


def commit() -> str:
    """The commit measured, with `+changes` when its code differed from it (documents and
    results aside: they change nothing measured)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs",
                  ":!*.md", ":!bench/results")
    return head + ("+changes" if changed else "")
