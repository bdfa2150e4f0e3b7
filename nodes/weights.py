"""Where an engine's weights come from on this node: the demo model (built here), a local
folder, or the node's model cache, which downloads a hub model's pinned files once and keeps
them (engine.model_cache). Engines always load from a folder here, offline.

Models and adapters are as the node channel gives them (fleet.selectors): plain dicts. What
only the control plane holds (a hub token, an uploaded adapter's files, the commit a model is
pinned to) is asked of it for the replica being served, through the channel.
"""

import hashlib
import shutil
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine import demo_model
from engine.hub import HubFile, HubRefusal
from engine.model_cache import DownloadFailed, ModelCache, Progress
from engine.sizing import GIB
from nodes.channel import ChannelRefused, NodeChannel
from nodes.config import AgentConfig

DEMO_SLUG = "kvrun-demo-tiny"
UPLOAD = "upload"  # an adapter's source when its files were uploaded, not on the hub


def model_cache(config: AgentConfig) -> ModelCache:
    return ModelCache(config.model_dir / "hub", budget_bytes=config.model_cache_gib * GIB)


def local_weights(model: dict[str, Any], *, config: AgentConfig) -> Path | None:
    """A built-in model (engine.demo_model, built on first use), a folder named by the slug under
    the model directory, or the folder a checkpoint was imported from; None for a hub model.
    Only the public catalog's models are looked for in folders: an organisation names its
    own models, and must never point an engine at a folder an operator put there."""
    if not model["catalog"]:
        return None
    if model["slug"] in demo_model.BUILT_IN:
        return demo_model.build(config.model_dir / model["slug"],
                                demo_model.BUILT_IN[model["slug"]])
    for folder in (config.model_dir / model["slug"], Path(model["hf_repo"])):
        if folder.is_absolute() and folder.is_dir():
            return folder
    return None


def needs_download(model: dict[str, Any], *, config: AgentConfig) -> bool:
    return local_weights(model, config=config) is None and not (
        model["hf_commit"] and model_cache(config).holds(model["hf_repo"], model["hf_commit"]))


def weights_dir(model: dict[str, Any], *, config: AgentConfig) -> Path:
    """The folder the engine loads `model` from; the model cache's is there once fetched."""
    local = local_weights(model, config=config)
    if local is not None:
        return local
    model_cache(config).touch(model["hf_repo"], model["hf_commit"])
    return model_cache(config).snapshot(model["hf_repo"], model["hf_commit"])


def fetch(*, model: dict[str, Any], token: str | None, channel: NodeChannel,
          config: AgentConfig,
          on_progress: Callable[[Progress], bool] = lambda progress: True) -> None:
    """Download `model`'s pinned files into this node's cache with the hub token the control
    plane gave for this download (None for a public model), keeping every model a replica
    here uses. Raises what engine.model_cache and engine.hub raise."""
    try:
        model_cache(config).fetch(
            endpoint=config.hub_url, repo_id=model["hf_repo"],
            commit=model["hf_commit"], token=token, in_use=lambda: in_use(channel, config),
            files=[HubFile(**file) for file in model["files"]], on_progress=on_progress)
    finally:
        report(channel, config)


def in_use(channel: NodeChannel, config: AgentConfig) -> set[Path]:
    """The cached snapshots of the models this node's replicas use or are about to, and of
    their endpoints' adapters."""
    cache = model_cache(config)
    return {cache.snapshot(repo, commit) for replica in channel.replicas()
            for repo, commit in replica["pinned"]}


def adapter_folder(adapter: dict[str, Any], *, config: AgentConfig) -> Path:
    """Where `adapter`'s files are on this node once fetched or written out."""
    return model_cache(config).root / adapter["folder"]


def adapter_dir(adapter: dict[str, Any], *, replica_id: str, channel: NodeChannel,
                config: AgentConfig) -> Path:
    """The folder an engine loads `adapter` (of the replica `replica_id`'s endpoint) from on
    this node: its hub commit, fetched into the model cache (and checked) on first use, or
    its upload, written out from the control plane's copy and checked against the digests
    taken when it was added. Raises what fetch raises, and DownloadFailed for an upload that
    does not match, or that was removed meanwhile."""
    files = [HubFile(**file) for file in adapter["files"]]
    if adapter["source"] != UPLOAD:
        return model_cache(config).fetch(
            endpoint=config.hub_url, repo_id=adapter["hf_repo"],
            commit=adapter["hf_commit"], files=files, in_use=lambda: in_use(channel, config),
            token=channel.hub_token(replica_id, adapter_id=adapter["id"]))
    target = adapter_folder(adapter, config=config)
    if all((target / file.path).is_file() for file in files):
        return target
    # Written beside, then renamed: an engine never reads half an adapter, and two writers
    # at once each finish their own copy (the second rename finds the first's and keeps it).
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}.partial")
    partial.mkdir(parents=True)
    try:
        for file in files:
            try:
                content = channel.adapter_file(replica_id, adapter_id=adapter["id"],
                                               path=file.path)
            except ChannelRefused as exc:
                raise DownloadFailed(f"adapter {adapter['name']} was removed while it was "
                                     "written out") from exc
            if hashlib.sha256(content).hexdigest() != file.sha256:
                raise DownloadFailed(f"the uploaded {file.path} of adapter {adapter['name']} "
                                     "does not match the digest taken when it was added")
            (partial / file.path).write_bytes(content)
        try:
            partial.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def report(channel: NodeChannel, config: AgentConfig) -> None:
    """Tell the control plane what this node's model cache holds now."""
    channel.record_model_cache(entries=[
        {"repo_id": entry.repo_id, "commit": entry.commit, "bytes": entry.size,
         "last_used": datetime.fromtimestamp(entry.last_used, UTC).isoformat()}
        for entry in model_cache(config).entries()])


def failure_reason(exc: Exception) -> str:
    """Why fetching the weights failed, in words for the replica's failure reason."""
    if isinstance(exc, HubRefusal):
        return exc.message
    return str(exc) or type(exc).__name__
