"""A node's model cache: hub checkpoints pinned at a commit, downloaded once, checked, kept.

Pure Python, no Django. Under its root, one folder per repository (`owner--name`) holds:

    <commit>/          a complete snapshot, checked file by file: the only thing engines load
    <commit>.partial/  a download under way or interrupted; the next fetch resumes it
    <commit>.lock      held by the one process fetching that commit
    <commit>.used      touched at every fetch and engine start: the least recently used go first

A snapshot appears by one rename once every file has the size and SHA-256 the hub states,
so a killed agent or a cut network never leaves a half model an engine could load. Files
come through the hub's own client; a file cut off midway is kept as `<name>.incomplete` and
the next fetch asks only for the rest (the client's own hf_hub_download starts a killed
download over). A cache over its budget evicts the snapshots used least recently, never one
in use.
"""

import fcntl
import hashlib
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from engine.hub import HubFile
from engine.sizing import GB

PROGRESS_SECONDS = 1.0
RATE_AFTER_SECONDS = 2.0
CHUNK_BYTES = 1 << 20
INCOMPLETE = ".incomplete"


@dataclass(frozen=True)
class Progress:
    done_bytes: int
    total_bytes: int
    bytes_per_second: float

    @property
    def percent(self) -> int:
        return int(100 * self.done_bytes / self.total_bytes) if self.total_bytes else 100

    @property
    def seconds_left(self) -> float | None:
        if self.bytes_per_second <= 0:
            return None
        return (self.total_bytes - self.done_bytes) / self.bytes_per_second

    def describe(self) -> str:
        """Such as "downloading weights: 3.2 of 16.1 GB, 85 MB/s, about 2 min left"."""
        unit, size = _unit(self.total_bytes)
        text = (f"downloading weights: {self.done_bytes / size:.1f} of "
                f"{self.total_bytes / size:.1f} {unit}")
        if self.bytes_per_second > 0:
            text += f", {_rate(self.bytes_per_second)}"
        left = self.seconds_left
        if left is not None:
            text += f", about {_duration(left)} left"
        return text

    def describe_done(self, seconds: float) -> str:
        """Such as "downloaded 16.1 GB of weights in 3 min (85 MB/s)"."""
        unit, size = _unit(self.total_bytes)
        text = f"downloaded {self.total_bytes / size:.1f} {unit} of weights in {_duration(seconds)}"
        if self.bytes_per_second > 0:
            text += f" ({_rate(self.bytes_per_second)})"
        return text


UNITS = (("GB", GB), ("MB", 1e6), ("kB", 1e3))


def _unit(amount: float) -> tuple[str, float]:
    """The largest unit `amount` is at least one of (kB for less)."""
    return next((unit, size) for unit, size in UNITS if amount >= size or size == UNITS[-1][1])


def _rate(bytes_per_second: float) -> str:
    unit, size = _unit(bytes_per_second)
    return f"{bytes_per_second / size:.0f} {unit}/s"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class Entry:
    repo_id: str
    commit: str
    path: Path
    size: int
    last_used: float  # epoch seconds


class CacheFull(Exception):
    """The cache cannot take a model without evicting one in use."""


class DownloadFailed(Exception):
    """The files could not be fetched, or did not match what the hub states."""


class Cancelled(Exception):
    """The caller stopped wanting the model (its replica was stopped) mid-download."""


class ModelCache:
    def __init__(self, root: Path, *, budget_bytes: int) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes

    def snapshot(self, repo_id: str, commit: str) -> Path:
        """Where the complete snapshot of `repo_id` at `commit` is (or will be)."""
        return self.root / repo_id.replace("/", "--") / commit

    def holds(self, repo_id: str, commit: str) -> bool:
        return self.snapshot(repo_id, commit).is_dir()

    def touch(self, repo_id: str, commit: str) -> None:
        """Mark the snapshot used now (an engine starts on it)."""
        used = self.snapshot(repo_id, commit).with_suffix(".used")
        used.parent.mkdir(parents=True, exist_ok=True)
        used.touch()

    def entries(self) -> list[Entry]:
        """The complete snapshots, least recently used first."""
        found = []
        for repository in sorted(self.root.glob("*--*")):
            for folder in repository.iterdir():
                if folder.is_dir() and "." not in folder.name:
                    used = folder.with_suffix(".used")
                    found.append(Entry(
                        repo_id=repository.name.replace("--", "/", 1), commit=folder.name,
                        path=folder, size=_size_of(folder),
                        last_used=used.stat().st_mtime if used.exists() else 0.0))
        return sorted(found, key=lambda entry: entry.last_used)

    def fetch(self, *, endpoint: str, repo_id: str, commit: str, files: Sequence[HubFile],
              token: str | None, in_use: Callable[[], Collection[Path]] = lambda: (),
              on_progress: Callable[[Progress], bool] = lambda progress: True) -> Path:
        """The snapshot of `repo_id` at `commit`, downloading `files` from the hub at
        `endpoint` first unless it is already here; nothing is downloaded then.

        `on_progress` hears how far the download is about once a second; when it returns
        False the fetch stops after the file under way, keeps what it has for the next one,
        and raises Cancelled. Raises CacheFull when room cannot be made without evicting a
        snapshot in `in_use`, DownloadFailed when a file cannot be fetched or differs from
        what the hub states. `in_use` names the snapshots replicas use now (read once this
        fetch has the model's lock, so a long wait does not make it stale). `token` is used
        for this download only. A fetch that finds another under way for the same commit
        waits for it, telling `on_progress` how far that one is."""
        target = self.snapshot(repo_id, commit)
        partial = target.with_suffix(".partial")
        total = sum(f.size for f in files)
        with self._locked(target, lambda: on_progress(Progress(
                done_bytes=min(total, _size_of(partial)), total_bytes=total,
                bytes_per_second=0.0))):
            if not target.is_dir():
                self._make_room(total - min(total, _size_of(partial)),
                                keep={*in_use(), target})
                digests = self._download(endpoint=endpoint, repo_id=repo_id, commit=commit,
                                         files=files, token=token, partial=partial,
                                         on_progress=on_progress)
                _check(partial, files, digests)
                partial.rename(target)
            self.touch(repo_id, commit)
        return target

    @contextmanager
    def _locked(self, target: Path, waiting: Callable[[], bool]) -> Iterator[None]:
        """Hold the commit's lock; while another process or thread holds it, ask `waiting`
        about once a second whether to go on waiting (Cancelled when not)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # a start of the same model is downloading it
                    if not waiting():
                        raise Cancelled(
                            f"the wait for {target.parent.name} was stopped") from None
                    time.sleep(PROGRESS_SECONDS)
            yield

    def _make_room(self, needed: int, *, keep: set[Path]) -> None:
        entries = self.entries()
        partials = sum(_size_of(folder) for folder in self.root.glob("*--*/*.partial"))
        free = self.budget_bytes - sum(entry.size for entry in entries) - partials
        for entry in entries:
            if free >= needed:
                return
            if entry.path in keep:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            entry.path.with_suffix(".used").unlink(missing_ok=True)
            free += entry.size
        if free < needed:
            raise CacheFull(
                f"the node's model cache ({self.budget_bytes / GB:.1f} GB) cannot take "
                f"{needed / GB:.1f} GB more without evicting models in use")

    def _download(self, *, endpoint: str, repo_id: str, commit: str,
                  files: Sequence[HubFile], token: str | None, partial: Path,
                  on_progress: Callable[[Progress], bool]) -> dict[str, str]:
        """Fetch what is missing of `files` into `partial`; returns the SHA-256 of each file
        hashed as it arrived (one fetched whole by an earlier attempt is hashed when
        checked)."""
        total = sum(f.size for f in files)
        stop = threading.Event()
        failure: list[BaseException] = []
        digests: dict[str, str] = {}

        def download() -> None:
            try:
                for file in files:
                    if stop.is_set():
                        return
                    digest = _download_file(endpoint=endpoint, repo_id=repo_id, commit=commit,
                                            file=file, token=token, folder=partial)
                    if digest:
                        digests[file.path] = digest
            except BaseException as exc:  # reported by the waiting thread
                failure.append(exc)

        worker = threading.Thread(target=download, daemon=True)
        began, start_bytes = time.monotonic(), min(total, _size_of(partial))
        worker.start()
        while worker.is_alive():
            worker.join(PROGRESS_SECONDS)
            done = min(total, _size_of(partial))
            elapsed = time.monotonic() - began
            # A rate (and the time left from it) only once it means something: the first
            # second is mostly the connection being made.
            rate = (done - start_bytes) / elapsed if elapsed >= RATE_AFTER_SECONDS else 0.0
            try:
                going_on = on_progress(Progress(done_bytes=done, total_bytes=total,
                                                bytes_per_second=rate))
            except BaseException:
                # The download must not go on writing after its lock is let go.
                stop.set()
                worker.join()
                raise
            if not going_on:
                stop.set()
        if failure:
            raise DownloadFailed(f"fetching {repo_id} at {commit[:12]} failed: "
                                 f"{type(failure[0]).__name__}: {failure[0]}") from failure[0]
        if stop.is_set():
            raise Cancelled(f"the download of {repo_id} was stopped")
        return digests


def _download_file(*, endpoint: str, repo_id: str, commit: str, file: HubFile,
                   token: str | None, folder: Path) -> str | None:
    """Fetch one file into `folder` through the hub's client, going on from what an earlier,
    interrupted fetch wrote (a ranged request); the file takes its name once whole. Returns
    its SHA-256, hashed as it was written (None when it was already here)."""
    final = folder / file.path
    if final.is_file() and final.stat().st_size == file.size:
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    incomplete = final.with_name(final.name + INCOMPLETE)
    secret: str | bool = token or False
    metadata = get_hf_file_metadata(
        hf_hub_url(repo_id, file.path, revision=commit, endpoint=endpoint), token=secret,
        endpoint=endpoint)
    with open(incomplete, "a+b") as out:
        if out.tell() > file.size:  # not this file's beginning: start again
            out.truncate(0)
        hashing = _HashingWriter(out)
        try:
            # The client writes, tells, seeks and truncates: all a _HashingWriter does.
            http_get(metadata.location, cast(BinaryIO, hashing), resume_size=out.tell(),
                     headers=build_hf_headers(token=secret), expected_size=file.size)
        finally:
            digest = hashing.hexdigest()
    incomplete.rename(final)
    return digest


class _HashingWriter:
    """A file being downloaded, hashed as it is written, on a thread of its own (hashlib lets
    go of the GIL for large buffers, so hashing overlaps the download): checking a snapshot
    then costs no second read of its weights. What an earlier attempt wrote is hashed first;
    should the client rewind (a server that ignored its range), the hash is dropped and the
    file is hashed when checked."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.name = out.name
        self.valid = True
        self._digest = hashlib.sha256()
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
        self._hasher = threading.Thread(target=self._hash, daemon=True)
        self._hasher.start()
        out.seek(0)
        for chunk in iter(lambda: out.read(CHUNK_BYTES), b""):
            self._chunks.put(chunk)

    def _hash(self) -> None:
        for chunk in iter(self._chunks.get, None):
            self._digest.update(chunk)

    def write(self, data: bytes) -> int:
        if self.valid:
            self._chunks.put(bytes(data))
        return self.out.write(data)

    def tell(self) -> int:
        return self.out.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        self.valid = False
        return self.out.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        self.valid = False
        return self.out.truncate(size)

    def hexdigest(self) -> str | None:
        """The SHA-256 of what was written, once the hasher has caught up; None if dropped.
        Ends the hasher: call it once, when the download is over (or failed)."""
        self._chunks.put(None)
        self._hasher.join()
        return str(self._digest.hexdigest()) if self.valid else None


def _check(folder: Path, files: Sequence[HubFile], digests: dict[str, str]) -> None:
    """Every file there, with the size and (where the hub states one) the SHA-256 stated."""
    for file in files:
        path = folder / file.path
        if not path.is_file() or path.stat().st_size != file.size:
            path.unlink(missing_ok=True)  # fetched again next time
            raise DownloadFailed(f"{file.path} is not the {file.size:,} bytes the hub states")
        if file.sha256 and (digests.get(file.path) or _sha256(path)) != file.sha256:
            path.unlink()
            raise DownloadFailed(f"{file.path} does not match the SHA-256 the hub states")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _size_of(folder: Path) -> int:
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(base, name)).st_size
            except FileNotFoundError:  # moved by the download under way
                continue
    return total
