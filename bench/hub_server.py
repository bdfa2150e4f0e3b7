"""A Hugging Face hub on loopback, for the models benchmark and the tests.

It speaks the part of the hub's HTTP API that the hub's own client (huggingface_hub) uses
to read a model: a repository's info at a revision, and its files by HEAD and ranged GET
under /resolve/, with the hub's headers (X-Repo-Commit, ETag, X-Error-Code). Repositories
live on disk, one folder per commit; `publish` adds a commit and moves a branch or tag to
it. Gated and private repositories answer as the hub does: a private one is "not found"
to anyone without a token that may read it (401 without a token, 404 with one); a gated
one shows its info to all and its files only to tokens granted it (401 without a token,
403 with one). A token the hub does not know is refused as invalid.

The server counts the bytes of file content it sends, and can be slowed to a rate, so a
test can see a download in progress or check that a start downloaded nothing.
"""

import hashlib
import json
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".gguf")
CHUNK_BYTES = 1 << 20
API_PATH = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
RESOLVE_PATH = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Repository:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag: commit
    private: bool = False
    gated: bool = False
    readers: set[str] = field(default_factory=set)  # tokens that may read it when restricted
    licence: str | None = None


class Hub:
    """The repositories under `root`, served at `url` once started."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.repositories: dict[str, Repository] = {}
        self.tokens: set[str] = set()  # every token the hub knows
        self.bytes_sent = 0
        self.rate_bytes_per_second: float | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start the hub first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def publish(self, repo_id: str, folder: Path, *, branch: str = "main",
                tags: tuple[str, ...] = (), private: bool = False, gated: bool = False,
                readers: tuple[str, ...] = (), licence: str | None = None) -> str:
        """Commit the files of `folder` to `repo_id`, move `branch` (and `tags`) to the commit,
        and return the commit's id (a digest of the files, so the same files give the same
        commit)."""
        digest = hashlib.sha1(repo_id.encode())
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        for path in files:
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(_sha256(path).encode())
        commit = digest.hexdigest()
        target = self.root / repo_id / commit
        if not target.exists():
            shutil.copytree(folder, target)
        with self._lock:
            repository = self.repositories.setdefault(repo_id, Repository())
            repository.private, repository.gated = private, gated
            repository.licence = licence
            repository.readers.update(readers)
            self.tokens.update(readers)
            for ref in (branch, *tags):
                repository.refs[ref] = commit
        return commit

    def start(self) -> "Hub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def count(self, sent: int) -> None:
        with self._lock:
            self.bytes_sent += sent

    def commit_of(self, repo_id: str, revision: str) -> str | None:
        repository = self.repositories.get(repo_id)
        if repository is None:
            return None
        if revision in repository.refs:
            return repository.refs[revision]
        if re.fullmatch(r"[0-9a-f]{40}", revision) and (self.root / repo_id / revision).is_dir():
            return revision
        return None


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet in test output
        return None

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if match := API_PATH.match(path):
            self._info(match.group(1), match.group(2) or "main")
        elif match := RESOLVE_PATH.match(path):
            self._file(match.group(1), match.group(2), match.group(3), body=body)
        else:
            self._error(404, "RepoNotFound", "Not found")

    def _token(self) -> str | None:
        header = self.headers.get("Authorization", "")
        return header.removeprefix("Bearer ").strip() or None

    def _access(self, repo_id: str, *, files: bool) -> bool:
        """Whether the request may go on; answers the refusal itself when not."""
        token = self._token()
        if token is not None and token not in self.hub.tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        repository = self.hub.repositories.get(repo_id)
        granted = repository is not None and token in repository.readers
        if repository is None or (repository.private and not granted):
            self._error(404 if token else 401, "RepoNotFound", "Repository not found")
            return False
        if repository.gated and files and not granted:
            self._error(403 if token else 401, "GatedRepo", "Access to this repo is restricted")
            return False
        return True

    def _info(self, repo_id: str, revision: str) -> None:
        if not self._access(repo_id, files=False):
            return
        commit = self.hub.commit_of(repo_id, revision)
        if commit is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return
        repository = self.hub.repositories[repo_id]
        folder = self.hub.root / repo_id / commit
        siblings = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            sibling: dict[str, object] = {"rfilename": str(path.relative_to(folder)),
                                          "size": path.stat().st_size,
                                          "blobId": _git_blob_id(path)}
            if path.suffix in LFS_SUFFIXES:
                sibling["lfs"] = {"sha256": _sha256(path), "size": path.stat().st_size,
                                  "pointerSize": 134}
            siblings.append(sibling)
        payload = json.dumps({"id": repo_id, "sha": commit, "private": repository.private,
                              "gated": "manual" if repository.gated else False,
                              "cardData": {"license": repository.licence},
                              "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _file(self, repo_id: str, revision: str, name: str, *, body: bool) -> None:
        if not self._access(repo_id, files=True):
            return
        commit = self.hub.commit_of(repo_id, revision)
        if commit is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return
        path = self.hub.root / repo_id / commit / name
        if not path.is_file():
            self._error(404, "EntryNotFound", "Entry not found")
            return
        size = path.stat().st_size
        start, end = 0, size - 1
        ranged = RANGE.match(self.headers.get("Range", "").strip().lower())
        if ranged:
            start = int(ranged.group(1))
            end = min(int(ranged.group(2)) if ranged.group(2) else size - 1, size - 1)
            if start >= size:
                self._error(416, None, "Range not satisfiable")
                return
        self.send_response(206 if ranged else 200)
        self.send_header("X-Repo-Commit", commit)
        etag = _sha256(path) if path.suffix in LFS_SUFFIXES else _git_blob_id(path)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body:
            self._send(path, start, end)

    def _send(self, path: Path, start: int, end: int) -> None:
        began = time.monotonic()
        sent = 0
        with open(path, "rb") as handle:
            handle.seek(start)
            rate = self.hub.rate_bytes_per_second
            # Slowed, in pieces of a tenth of a second's worth: the pace shows as it goes.
            piece = min(CHUNK_BYTES, max(4096, int(rate / 10))) if rate else CHUNK_BYTES
            while sent < end - start + 1:
                chunk = handle.read(min(piece, end - start + 1 - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    return
                sent += len(chunk)
                self.hub.count(len(chunk))
                rate = self.hub.rate_bytes_per_second
                if rate:
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)

    def _error(self, status: int, code: str | None, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)


_digests: dict[tuple[Path, float, str], str] = {}


def _sha256(path: Path) -> str:
    return _digest(path, "sha256")


def _git_blob_id(path: Path) -> str:
    return _digest(path, "git")


def _digest(path: Path, kind: str) -> str:
    key = (path, path.stat().st_mtime, kind)
    if key not in _digests:
        hasher = hashlib.sha256() if kind == "sha256" else hashlib.sha1(
            b"blob %d\0" % path.stat().st_size)
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
                hasher.update(chunk)
        _digests[key] = hasher.hexdigest()
    return _digests[key]
