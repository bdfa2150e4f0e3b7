import shutil
from pathlib import Path

from engine.devices import Device, detect, host_memory_bytes, parse_nvidia_smi


def test_it_parses_what_nvidia_smi_prints() -> None:
    output = "0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n"

    assert parse_nvidia_smi(output) == [
        Device(index=0, name="NVIDIA H200", memory_bytes=143771 * 2**20),
        Device(index=1, name="NVIDIA H200", memory_bytes=143771 * 2**20),
    ]


def test_it_reads_host_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree: 10 kB\nMemTotal:       24576000 kB\n")

    assert host_memory_bytes(str(meminfo)) == 24576000 * 1024


def test_a_host_without_a_driver_has_no_gpus(monkeypatch: object, tmp_path: Path) -> None:
    monkeypatch.setenv("KVRUN_NODE_GPUS", "none")

    resources = detect(tmp_path)

    assert resources.devices == []
    assert resources.cpu_count >= 1 and resources.memory_bytes > 2**30
    assert resources.disk_bytes == shutil.disk_usage(tmp_path).total
