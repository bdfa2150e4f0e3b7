"""The vLLM build beside a node agent: its version and the model architectures it runs.

A node reports both when it registers, so that adding a model is judged against the
engines actually online rather than a list kept by hand. Reading the architectures imports
vLLM's model registry (torch with it: seconds of CPU), so it runs in a child process once
per build, and the answer is kept in a file named by the build's version.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.kv_policy import installed_version

REGISTRY_QUERY = ("import json; from vllm.model_executor.models.registry import ModelRegistry; "
                  "print(json.dumps(sorted(ModelRegistry.get_supported_archs())))")
QUERY_TIMEOUT_SECONDS = 300


@dataclass(frozen=True)
class EngineBuild:
    version: str  # empty where no vLLM is installed
    architectures: tuple[str, ...]


def detect(*, device: str, cache_dir: Path, python: str = sys.executable) -> EngineBuild:
    """The build for `device` installed beside `python`; no architectures without one."""
    version = installed_version(device)
    if version is None:
        return EngineBuild(version="", architectures=())
    kept = Path(cache_dir) / f"vllm-{version}-architectures.json"
    if kept.exists():
        return EngineBuild(version=version, architectures=tuple(json.loads(kept.read_text())))
    answer = subprocess.run([python, "-c", REGISTRY_QUERY], capture_output=True, text=True,
                            timeout=QUERY_TIMEOUT_SECONDS, check=True)
    architectures = json.loads(answer.stdout.strip().splitlines()[-1])
    kept.parent.mkdir(parents=True, exist_ok=True)
    written = kept.with_suffix(".tmp")
    written.write_text(json.dumps(architectures))
    written.replace(kept)
    return EngineBuild(version=version, architectures=tuple(architectures))
