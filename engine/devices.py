"""What a host has to offer an engine: its GPUs (from the NVIDIA driver), CPUs, memory and
disk.

Pure Python, no Django: the node agent calls it and sends the result to the control plane.
"""

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1024 * 1024


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class HostResources:
    devices: list[Device]
    cpu_count: int
    memory_bytes: int
    disk_bytes: int = 0  # of the file system its engines' KV tiers and the model cache are on

    def devices_as_dicts(self) -> list[dict[str, object]]:
        return [asdict(device) for device in self.devices]


def detect(disk: Path) -> HostResources:
    """The host's resources, its disk being the file system that holds `disk`."""
    return HostResources(devices=detect_gpus(), cpu_count=os.cpu_count() or 1,
                         memory_bytes=host_memory_bytes(),
                         disk_bytes=shutil.disk_usage(disk).total)


def detect_gpus() -> list[Device]:
    """GPUs as the driver reports them; none where there is no NVIDIA driver.

    nvidia-smi rather than torch: importing torch costs seconds and memory on every agent start.
    """
    if os.environ.get("KVRUN_NODE_GPUS") == "none" or shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    if result.returncode != 0:
        return []
    return parse_nvidia_smi(result.stdout)


def parse_nvidia_smi(output: str) -> list[Device]:
    devices = []
    for line in output.strip().splitlines():
        index, name, memory_mib = (part.strip() for part in line.split(","))
        devices.append(Device(index=int(index), name=name, memory_bytes=int(memory_mib) * MIB))
    return devices


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemTotal in {meminfo}")
