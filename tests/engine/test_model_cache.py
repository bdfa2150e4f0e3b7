"""A node's model cache (engine.model_cache) against the hub on loopback."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.hub_server import Hub
from engine import hub
from engine.hub import HubFile
from engine.model_cache import CacheFull, Cancelled, DownloadFailed, ModelCache, Progress
from tests.helpers import ROOT, wait_until

MB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Hub]:
    server = Hub(tmp_path / "hub").start()
    yield server
    server.stop()


def publish(served: Hub, repo_id: str, folder: Path, **sizes: int) -> list[HubFile]:
    """A repository of files of the sizes given (random bytes), and what kvrun would fetch."""
    folder.mkdir(parents=True)
    for name, size in sizes.items():
        (folder / name.replace("_", ".")).write_bytes(os.urandom(size))
    served.publish(repo_id, folder)
    return list(hub.pin(endpoint=served.url, repo_id=repo_id)[1])


def fetch(cache: ModelCache, served: Hub, repo_id: str, files: list[HubFile],
          **kwargs: object) -> Path:
    return cache.fetch(endpoint=served.url, repo_id=repo_id,
                       commit=served.commit_of(repo_id, "main") or "", files=files, token=None,
                       **kwargs)  # type: ignore[arg-type]


def test_a_model_is_fetched_once_checked_and_kept(served: Hub, tmp_path: Path) -> None:
    files = publish(served, "acme/small", tmp_path / "small", config_json=100,
                    model_safetensors=3 * MB)
    cache = ModelCache(tmp_path / "cache", budget_bytes=100 * MB)
    heard: list[Progress] = []

    def hear(progress: Progress) -> bool:
        heard.append(progress)
        return True

    snapshot = fetch(cache, served, "acme/small", files, on_progress=hear)
    sent = served.bytes_sent
    again = fetch(cache, served, "acme/small", files)

    assert snapshot == again and sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "model.safetensors"]
    assert (snapshot / "model.safetensors").read_bytes() == (
        tmp_path / "small" / "model.safetensors").read_bytes()
    assert served.bytes_sent == sent == 3 * MB + 100  # the second fetch downloaded nothing
    assert heard[-1].done_bytes == heard[-1].total_bytes == 3 * MB + 100
    assert not snapshot.with_suffix(".partial").exists()
    assert [entry.repo_id for entry in cache.entries()] == ["acme/small"]


def test_a_gated_model_downloads_with_a_granted_token_only(served: Hub, tmp_path: Path) -> None:
    folder = tmp_path / "gated"
    folder.mkdir()
    (folder / "config.json").write_bytes(os.urandom(100))
    (folder / "model.safetensors").write_bytes(os.urandom(MB))
    commit = served.publish("acme/gated", folder, gated=True, readers=("hf_granted",))
    served.publish("acme/other", folder, gated=True, readers=("hf_other",))
    _, files = hub.pin(endpoint=served.url, repo_id="acme/gated", token="hf_granted")
    cache = ModelCache(tmp_path / "cache", budget_bytes=100 * MB)

    for token, status in ((None, "401"), ("hf_other", "403")):
        with pytest.raises(DownloadFailed, match=status):
            cache.fetch(endpoint=served.url, repo_id="acme/gated", commit=commit, files=files,
                        token=token)
        assert cache.entries() == []
    snapshot = cache.fetch(endpoint=served.url, repo_id="acme/gated", commit=commit,
                           files=files, token="hf_granted")

    assert (snapshot / "model.safetensors").read_bytes() == (
        folder / "model.safetensors").read_bytes()
    assert [entry.repo_id for entry in cache.entries()] == ["acme/gated"]


def test_progress_reads_as_a_person_would_want_it() -> None:
    progress = Progress(done_bytes=3_200_000_000, total_bytes=16_100_000_000,
                        bytes_per_second=85_000_000)

    assert progress.describe() == ("downloading weights: 3.2 of 16.1 GB, 85 MB/s, "
                                   "about 3 min left")
    assert progress.percent == 19
    small = Progress(done_bytes=400_000, total_bytes=1_500_000, bytes_per_second=262_144)
    assert small.describe() == "downloading weights: 0.4 of 1.5 MB, 262 kB/s, about 4 s left"
    done = Progress(done_bytes=16_100_000_000, total_bytes=16_100_000_000,
                    bytes_per_second=85_000_000)
    assert done.describe_done(190) == "downloaded 16.1 GB of weights in 3 min (85 MB/s)"


def test_a_file_unlike_what_the_hub_states_is_never_made_a_snapshot(
        served: Hub, tmp_path: Path) -> None:
    files = publish(served, "acme/tampered", tmp_path / "t", model_safetensors=MB)
    wrong = [HubFile(path=f.path, size=f.size, sha256="0" * 64) for f in files]
    cache = ModelCache(tmp_path / "cache", budget_bytes=100 * MB)

    with pytest.raises(DownloadFailed, match="does not match the SHA-256"):
        fetch(cache, served, "acme/tampered", wrong)

    assert not cache.holds("acme/tampered", served.commit_of("acme/tampered", "main") or "")
    assert fetch(cache, served, "acme/tampered", files).is_dir()  # fetched again, right


def test_the_least_recently_used_model_makes_room_and_one_in_use_never_does(
        served: Hub, tmp_path: Path) -> None:
    old = publish(served, "acme/old", tmp_path / "old", model_safetensors=4 * MB)
    recent = publish(served, "acme/recent", tmp_path / "recent", model_safetensors=4 * MB)
    new = publish(served, "acme/new", tmp_path / "new", model_safetensors=4 * MB)
    cache = ModelCache(tmp_path / "cache", budget_bytes=9 * MB)
    old_path = fetch(cache, served, "acme/old", old)
    recent_path = fetch(cache, served, "acme/recent", recent)
    os.utime(old_path.with_suffix(".used"), (time.time() - 60, time.time() - 60))

    with pytest.raises(CacheFull, match="without evicting models in use"):
        fetch(cache, served, "acme/new", new, in_use=lambda: {old_path, recent_path})
    fetch(cache, served, "acme/new", new, in_use=lambda: {recent_path})

    assert {entry.repo_id for entry in cache.entries()} == {"acme/recent", "acme/new"}
    assert not old_path.exists() and recent_path.exists()


FETCH_IN_A_CHILD = """
import sys
from engine.hub import HubFile
from engine.model_cache import ModelCache
url, commit, root, size, sha = sys.argv[1:]
ModelCache(root, budget_bytes=10**9).fetch(
    endpoint=url, repo_id="acme/big", commit=commit, token=None,
    files=[HubFile(path="model.safetensors", size=int(size), sha256=sha)])
"""


def test_a_download_killed_midway_resumes_and_never_leaves_a_loadable_half(
        served: Hub, tmp_path: Path) -> None:
    files = publish(served, "acme/big", tmp_path / "big", model_safetensors=48 * MB)
    commit = served.commit_of("acme/big", "main") or ""
    cache = ModelCache(tmp_path / "cache", budget_bytes=10**9)
    partial = cache.snapshot("acme/big", commit).with_suffix(".partial")
    served.rate_bytes_per_second = 16 * MB
    child = subprocess.Popen([sys.executable, "-c", FETCH_IN_A_CHILD, served.url, commit,
                              str(cache.root), str(files[0].size), str(files[0].sha256)],
                             cwd=ROOT)
    try:
        assert wait_until(lambda: served.bytes_sent >= 12 * MB, timeout=60), (
            "the download never got under way")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    kept = served.bytes_sent
    written = (partial / "model.safetensors.incomplete").stat().st_size

    assert 0 < written < 48 * MB and not cache.holds("acme/big", commit)
    served.rate_bytes_per_second = None
    snapshot = fetch(cache, served, "acme/big", files)

    assert served.bytes_sent - kept == 48 * MB - written  # only what it had not written
    assert (snapshot / "model.safetensors").read_bytes() == (
        tmp_path / "big" / "model.safetensors").read_bytes()
    assert not partial.exists()


def test_a_second_fetch_of_a_model_being_downloaded_waits_reporting_and_can_give_up(
        served: Hub, tmp_path: Path) -> None:
    import fcntl

    files = publish(served, "acme/shared", tmp_path / "shared", model_safetensors=MB)
    cache = ModelCache(tmp_path / "cache", budget_bytes=100 * MB)
    target = cache.snapshot("acme/shared", served.commit_of("acme/shared", "main") or "")
    target.parent.mkdir(parents=True)
    heard: list[Progress] = []

    def hear(progress: Progress) -> bool:
        heard.append(progress)
        return len(heard) < 2

    with open(target.with_suffix(".lock"), "w") as first:  # another start is downloading it
        fcntl.flock(first, fcntl.LOCK_EX)
        with pytest.raises(Cancelled, match="was stopped"):
            fetch(cache, served, "acme/shared", files, on_progress=hear)

    assert len(heard) == 2 and heard[0].total_bytes == MB
    assert served.bytes_sent == 0 and not target.exists()
