"""A model repository on a Hugging Face hub (the real one or a mirror), read without its weights.

Pure Python, no Django. `inspect` resolves a revision to its commit and reads config.json,
the tokenizer's config and every safetensors header (by range requests, through the hub's
own client), so a model is sized and judged before anything downloads or any device is
held. Every refusal is a `HubRefusal` whose message a person can act on, naming the field
to change. An access token is passed per call and never kept, logged or saved.
"""

import json
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import HfApi, ModelInfo
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    NotASafetensorsRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
)

from engine import lora, parsers
from engine.hf_checkpoint import Tensors, describe_config

DEFAULT_REVISION = "main"
# What an engine reads of a repository; weights in other formats (.bin, .pth, .gguf) and the
# `original/` copies some publishers add are never fetched.
ENGINE_FILE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
REMOTE_CODE_PATTERNS = ("*.py",)
EXCLUDED_PATTERNS = ("original/*",)
TIMEOUT_SECONDS = 20.0


class HubRefusal(ValueError):
    """Why a repository cannot be added, for the field a person should change
    (`hf_repo`, `hf_revision` or `hf_token`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None  # the hub states it for files kept in LFS (every weights file)


@dataclass(frozen=True)
class HubCheckpoint:
    """A repository pinned at one commit, as sizing and the model cache need it."""

    repo_id: str
    commit: str
    files: tuple[HubFile, ...]
    config: Mapping[str, Any]
    tensors: Tensors
    chat_template: bool
    remote_code: bool
    licence: str = "unknown"
    # What engine.parsers chooses by: the tokenizer's added tokens and its chat template.
    special_tokens: frozenset[str] = frozenset()
    chat_template_text: str = ""

    @property
    def architecture(self) -> str:
        return str((self.config.get("architectures") or ["unknown"])[0])

    @property
    def download_bytes(self) -> int:
        """What the model cache fetches and keeps: the files an engine reads."""
        return sum(f.size for f in engine_files(self.files, remote_code=self.remote_code))

    def describe(self) -> dict[str, Any]:
        """The catalog's sizing fields, as `hf_checkpoint.describe` gives them for the same
        checkpoint on disk."""
        fields = describe_config(self.config, self.tensors)
        fields["tool_call_parser"], fields["reasoning_parser"] = parsers.fitting(
            architecture=self.architecture, tokens=self.special_tokens,
            chat_template=self.chat_template_text)
        return fields


def engine_files(files: tuple[HubFile, ...], *, remote_code: bool) -> tuple[HubFile, ...]:
    patterns = ENGINE_FILE_PATTERNS + (REMOTE_CODE_PATTERNS if remote_code else ())
    return tuple(f for f in files if _matches(f.path, patterns)
                 and not _matches(f.path, EXCLUDED_PATTERNS))


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch(path, pattern) for pattern in patterns)


def inspect(*, endpoint: str, repo_id: str, revision: str | None = None,
            token: str | None = None) -> HubCheckpoint:
    """Resolve `revision` (a branch, tag or commit; `main` when None) of `repo_id` on the hub
    at `endpoint` to its commit and read what sizing needs. Raises HubRefusal."""
    api = HfApi(endpoint=endpoint, token=False)  # never a token saved on this host
    secret: str | bool = token or False
    asked = revision or DEFAULT_REVISION
    with _refusals(repo_id=repo_id, revision=asked, token=token, endpoint=endpoint):
        info = api.model_info(repo_id, revision=asked, files_metadata=True, token=secret,
                              timeout=TIMEOUT_SECONDS)
        commit, files = _pinned(info)
        licence = str(getattr(info.card_data, "license", None) or "unknown")
        names = {f.path for f in files}
        if "config.json" not in names:
            raise HubRefusal("hf_repo", f"{repo_id} has no config.json at {commit[:12]}: it "
                             "is not a Transformers checkpoint that vLLM can load.")
        with tempfile.TemporaryDirectory(prefix="kvrun-hub-") as scratch:
            def read(name: str) -> dict[str, Any]:
                path = api.hf_hub_download(repo_id, name, revision=commit, token=secret,
                                           local_dir=scratch, etag_timeout=TIMEOUT_SECONDS)
                return dict(json.loads(Path(path).read_text()))

            config = read("config.json")
            tokenizer = read("tokenizer_config.json") if "tokenizer_config.json" in names \
                else {}
            # Added tokens are in tokenizer.json alone where Transformers 5 saved it.
            added = read("tokenizer.json") if not tokenizer.get("added_tokens_decoder") and (
                "tokenizer.json" in names) else {}
            template = Path(api.hf_hub_download(
                repo_id, "chat_template.jinja", revision=commit, token=secret,
                local_dir=scratch, etag_timeout=TIMEOUT_SECONDS)).read_text() if (
                "chat_template.jinja" in names) else ""
        try:
            metadata = api.get_safetensors_metadata(repo_id, revision=commit, token=secret)
        except (NotASafetensorsRepoError, SafetensorsParsingError) as exc:
            raise HubRefusal("hf_repo", f"{repo_id} has no safetensors weights at "
                             f"{commit[:12]} (model.safetensors, or shards with an index): "
                             "kvrun loads safetensors only; pick a repository or revision "
                             "that has them.") from exc
    tensors = Tensors.of_headers(
        {name: {"shape": tensor.shape, "data_offsets": tensor.data_offsets}
         for name, tensor in file.tensors.items()}
        for file in metadata.files_metadata.values())
    return HubCheckpoint(
        repo_id=repo_id, commit=commit, files=files, config=config, tensors=tensors,
        chat_template=bool(tokenizer.get("chat_template")) or bool(
            names & {"chat_template.jinja", "chat_template.json"}),
        remote_code=bool(config.get("auto_map")), licence=licence[:40],
        special_tokens=frozenset(parsers.special_tokens(tokenizer, added)),
        chat_template_text=parsers.chat_template_text(tokenizer, template))


@dataclass(frozen=True)
class HubAdapter:
    """A LoRA adapter's repository pinned at one commit: its config and tensors' shapes."""

    repo_id: str
    commit: str
    files: tuple[HubFile, ...]
    config: Mapping[str, Any]
    tensors: Mapping[str, list[int]]


def inspect_adapter(*, endpoint: str, repo_id: str, revision: str | None = None,
                    token: str | None = None) -> HubAdapter:
    """Resolve `revision` of the adapter repository `repo_id` to its commit, and read its
    adapter_config.json and its weights' header (a range request). Raises HubRefusal."""
    api = HfApi(endpoint=endpoint, token=False)
    secret: str | bool = token or False
    asked = revision or DEFAULT_REVISION
    with _refusals(repo_id=repo_id, revision=asked, token=token, endpoint=endpoint):
        info = api.model_info(repo_id, revision=asked, files_metadata=True, token=secret,
                              timeout=TIMEOUT_SECONDS)
        commit, files = _pinned(info)
        names = {f.path for f in files}
        if not {lora.CONFIG_FILE, lora.WEIGHTS_FILE} <= names:
            raise HubRefusal("hf_repo", f"{repo_id} at {commit[:12]} is not a LoRA adapter: it "
                             f"needs {lora.CONFIG_FILE} and {lora.WEIGHTS_FILE}.")
        with tempfile.TemporaryDirectory(prefix="kvrun-hub-") as scratch:
            path = api.hf_hub_download(repo_id, lora.CONFIG_FILE, revision=commit,
                                       token=secret, local_dir=scratch,
                                       etag_timeout=TIMEOUT_SECONDS)
            try:
                config = json.loads(Path(path).read_text())
            except ValueError:
                config = None
        if not isinstance(config, dict):
            raise HubRefusal("hf_repo", f"{repo_id}'s {lora.CONFIG_FILE} is not a JSON object.")
        try:
            header = api.parse_safetensors_file_metadata(repo_id, lora.WEIGHTS_FILE,
                                                         revision=commit, token=secret)
        except SafetensorsParsingError as exc:
            raise HubRefusal("hf_repo", f"{repo_id}'s {lora.WEIGHTS_FILE} is not a safetensors "
                             "file.") from exc
    return HubAdapter(repo_id=repo_id, commit=commit,
                      files=tuple(f for f in files if f.path in (lora.CONFIG_FILE,
                                                                 lora.WEIGHTS_FILE)),
                      config=config, tensors={name: list(tensor.shape)
                                              for name, tensor in header.tensors.items()})


def pin(*, endpoint: str, repo_id: str, revision: str | None = None,
        token: str | None = None) -> tuple[str, tuple[HubFile, ...]]:
    """The commit `revision` of `repo_id` resolves to now, and its files. Raises
    HubRefusal."""
    asked = revision or DEFAULT_REVISION
    with _refusals(repo_id=repo_id, revision=asked, token=token, endpoint=endpoint):
        return _pinned(HfApi(endpoint=endpoint, token=False).model_info(
            repo_id, revision=asked, files_metadata=True, token=token or False,
            timeout=TIMEOUT_SECONDS))


def _pinned(info: ModelInfo) -> tuple[str, tuple[HubFile, ...]]:
    return str(info.sha), tuple(HubFile(path=s.rfilename, size=int(s.size or 0),
                                        sha256=s.lfs.sha256 if s.lfs else None)
                                for s in info.siblings or [])


@contextmanager
def _refusals(*, repo_id: str, revision: str, token: str | None,
              endpoint: str) -> Iterator[None]:
    """Turn the hub client's errors into HubRefusal, in words that say what to change."""
    try:
        yield
    except HubRefusal:
        raise
    except Exception as exc:
        refusal = _refusal(exc, repo=repo_id, revision=revision, token=token, endpoint=endpoint)
        if refusal is None:
            raise
        raise refusal from exc


def _refusal(exc: Exception, *, repo: str, revision: str, token: str | None,
             endpoint: str) -> HubRefusal | None:
    if isinstance(exc, HFValidationError):
        return HubRefusal("hf_repo", f"{repo!r} is not a hub id: write it as owner/name, such "
                          "as meta-llama/Llama-3.1-8B-Instruct.")
    if isinstance(exc, RevisionNotFoundError):
        return HubRefusal("hf_revision", f"{repo} has no branch, tag or commit {revision!r}: "
                          "check the revision on its hub page.")
    if isinstance(exc, GatedRepoError):
        if token:
            return HubRefusal("hf_token", f"This access token has not been granted {repo}, a "
                              "gated repository: accept its conditions on its hub page with "
                              "the token's account, then try again.")
        return HubRefusal("hf_token", f"{repo} is gated: request access on its hub page, then "
                          "add an access token of an account that has been granted it.")
    if isinstance(exc, RepositoryNotFoundError):
        if token:
            return HubRefusal("hf_repo", f"No repository {repo} that this access token can "
                              "read: check the id, and that the token's account can see the "
                              "repository.")
        return HubRefusal("hf_repo", f"No repository {repo} on the hub, or it is private: check "
                          "the id; for a private repository, add an access token that can "
                          "read it.")
    if isinstance(exc, EntryNotFoundError):
        return HubRefusal("hf_repo", f"{repo} lacks a file it lists; it cannot be loaded as "
                          "it stands.")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status == 401:
            return HubRefusal("hf_token", "The hub refused this access token (invalid or "
                              "expired): make a new read token and try again.")
        if status == 403:
            return HubRefusal("hf_token", f"This access token may not read {repo}: give it "
                              "read access to the repository, or use another token.")
        return HubRefusal("hf_repo", f"The hub answered {status} for {repo}; try again in a "
                          "few minutes.")
    if isinstance(exc, httpx2.HTTPError | OSError):  # the hub's client speaks httpx2
        return HubRefusal("hf_repo", f"The hub at {endpoint} could not be reached "
                          f"({type(exc).__name__}); try again, or ask an operator to check "
                          "kvrun's hub address (KVRUN_HUB_URL).")
    return None
