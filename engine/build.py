"""The vLLM build beside a node agent: its version, the model architectures it runs and the
tool-call and reasoning parsers it offers (engine.parsers).

A node reports them when it registers, so that adding a model is judged against the
engines actually online rather than a list kept by hand. Reading the architectures imports
vLLM's model registry (torch with it: seconds of CPU), so it runs in a child process once
per build, and the answer is kept in a file named by the build's version.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.kv_policy import installed_version

REGISTRY_QUERY = """
import importlib, json
from vllm.model_executor.models.registry import ModelRegistry
found = {"architectures": sorted(ModelRegistry.get_supported_archs())}
for key, module, manager in (("tool_parsers", "vllm.tool_parsers", "ToolParserManager"),
                             ("reasoning_parsers", "vllm.reasoning", "ReasoningParserManager")):
    try:  # a build that keeps them elsewhere goes without parsers, not without models
        found[key] = getattr(importlib.import_module(module), manager).list_registered()
    except Exception:
        found[key] = []
print(json.dumps(found))
"""
QUERY_TIMEOUT_SECONDS = 300


@dataclass(frozen=True)
class EngineBuild:
    version: str  # empty where no vLLM is installed
    architectures: tuple[str, ...]
    tool_parsers: tuple[str, ...] = ()
    reasoning_parsers: tuple[str, ...] = ()

    @classmethod
    def of(cls, version: str, read: dict[str, list[str]]) -> EngineBuild:
        return cls(version=version, architectures=tuple(read["architectures"]),
                   tool_parsers=tuple(read["tool_parsers"]),
                   reasoning_parsers=tuple(read["reasoning_parsers"]))


def detect(*, device: str, cache_dir: Path, python: str = sys.executable) -> EngineBuild:
    """The build for `device` installed beside `python`; no architectures without one."""
    version = installed_version(device)
    if version is None:
        return EngineBuild(version="", architectures=())
    kept = Path(cache_dir) / f"vllm-{version}-build.json"
    if kept.exists():
        return EngineBuild.of(version, json.loads(kept.read_text()))
    answer = subprocess.run([python, "-c", REGISTRY_QUERY], capture_output=True, text=True,
                            timeout=QUERY_TIMEOUT_SECONDS, check=True)
    read = json.loads(answer.stdout.strip().splitlines()[-1])
    kept.parent.mkdir(parents=True, exist_ok=True)
    written = kept.with_suffix(".tmp")
    written.write_text(json.dumps(read))
    written.replace(kept)
    return EngineBuild.of(version, read)
