"""Where an engine's weights come from on this node: the demo model (built here), a local
folder, or the node's model cache, which downloads a hub model's pinned files once and keeps
them (engine.model_cache). Engines always load from a folder here, offline."""

import hashlib
import shutil
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings

from endpoints.models import Adapter, AdapterSource, ModelSpec, Replica
from endpoints.selectors import hub_token_of
from endpoints.services import do_pin_model
from endpoints.states import HOLDING_DEVICES
from engine import demo_model
from engine.hub import HubFile, HubRefusal
from engine.model_cache import DownloadFailed, ModelCache, Progress
from engine.sizing import GIB
from fleet.reports import do_record_model_cache
from kvrun.common.sealing import InvalidToken

DEMO_SLUG = "kvrun-demo-tiny"


def model_cache() -> ModelCache:
    return ModelCache(Path(settings.KVRUN_MODEL_DIR) / "hub",
                      budget_bytes=settings.KVRUN_MODEL_CACHE_GIB * GIB)


def local_weights(model: ModelSpec) -> Path | None:
    """A built-in model (engine.demo_model, built on first use), a folder named by the slug under
    KVRUN_MODEL_DIR, or the folder a checkpoint was imported from; None for a hub model.
    Only the public catalog's models are looked for in folders: an organisation names its
    own models, and must never point an engine at a folder an operator put there."""
    if model.organization_id is not None:
        return None
    if model.slug in demo_model.BUILT_IN:
        return demo_model.build(Path(settings.KVRUN_MODEL_DIR) / model.slug,
                                demo_model.BUILT_IN[model.slug])
    for folder in (Path(settings.KVRUN_MODEL_DIR) / model.slug, Path(model.hf_repo)):
        if folder.is_absolute() and folder.is_dir():
            return folder
    return None


def needs_download(model: ModelSpec) -> bool:
    return local_weights(model) is None and not (
        model.hf_commit and model_cache().holds(model.hf_repo, model.hf_commit))


def weights_dir(model: ModelSpec) -> Path:
    """The folder the engine loads `model` from; the model cache's is there once fetched."""
    local = local_weights(model)
    if local is not None:
        return local
    model_cache().touch(model.hf_repo, model.hf_commit)
    return model_cache().snapshot(model.hf_repo, model.hf_commit)


def fetch(*, model: ModelSpec, node_name: str,
          on_progress: Callable[[Progress], bool]) -> ModelSpec:
    """Download `model`'s pinned files into this node's cache (pinning a catalog model that
    names only its hub id first), keeping every model a replica here uses. Returns the model
    as pinned. Raises what engine.model_cache and engine.hub raise."""
    token = hub_token_of(model)  # opened for this download only, and kept nowhere
    model = do_pin_model(model=model, token=token)
    cache = model_cache()
    try:
        cache.fetch(endpoint=settings.KVRUN_HUB_URL, repo_id=model.hf_repo,
                    commit=model.hf_commit, token=token, in_use=lambda: in_use(node_name),
                    files=[HubFile(**file) for file in model.files], on_progress=on_progress)
    finally:
        report(node_name)
    return model


def in_use(node_name: str) -> set[Path]:
    """The cached snapshots of the models this node's replicas use or are about to, and of
    their endpoints' adapters."""
    cache = model_cache()
    replicas = Replica.objects.filter(node__name=node_name, state__in=HOLDING_DEVICES)
    models = replicas.exclude(endpoint__model__hf_commit="").values_list(
        "endpoint__model__hf_repo", "endpoint__model__hf_commit")
    adapters = Adapter.objects.filter(
        endpoint__in=replicas.values("endpoint"), source=AdapterSource.HUB).values_list(
        "hf_repo", "hf_commit")
    return {cache.snapshot(repo, commit) for repo, commit in [*models, *adapters]}


def adapter_folder(adapter: Adapter) -> Path:
    """Where `adapter`'s files are on this node once fetched or written out."""
    return model_cache().root / adapter.folder


def adapter_dir(adapter: Adapter, *, node_name: str) -> Path:
    """The folder an engine loads `adapter` from on this node: its hub commit, fetched into
    the model cache (and checked) on first use, or its upload, written from the database and
    checked against the digests taken when it was added. Raises what fetch raises, and
    DownloadFailed for an upload that does not match, or that was removed meanwhile."""
    if adapter.source == AdapterSource.HUB:
        return model_cache().fetch(
            endpoint=settings.KVRUN_HUB_URL, repo_id=adapter.hf_repo, commit=adapter.hf_commit,
            token=hub_token_of(adapter), files=[HubFile(**file) for file in adapter.files],
            in_use=lambda: in_use(node_name))
    target = adapter_folder(adapter)
    wanted = {file["path"]: file["sha256"] for file in adapter.files}
    if all((target / path).is_file() for path in wanted):
        return target
    # Written beside, then renamed: an engine never reads half an adapter, and two writers
    # at once each finish their own copy (the second rename finds the first's and keeps it).
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}.partial")
    partial.mkdir(parents=True)
    try:
        uploads = {upload.path: upload for upload in adapter.uploads.all()}
        if uploads.keys() != wanted.keys():
            raise DownloadFailed(f"adapter {adapter.name} was removed while it was written out")
        for path, upload in uploads.items():
            content = bytes(upload.content)
            if hashlib.sha256(content).hexdigest() != wanted[path]:
                raise DownloadFailed(f"the uploaded {path} of adapter {adapter.name} does not "
                                     "match the digest taken when it was added")
            (partial / path).write_bytes(content)
        try:
            partial.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def report(node_name: str) -> None:
    """Tell the control plane what this node's model cache holds now."""
    do_record_model_cache(name=node_name, entries=[
        {"repo_id": entry.repo_id, "commit": entry.commit, "bytes": entry.size,
         "last_used": datetime.fromtimestamp(entry.last_used, UTC).isoformat()}
        for entry in model_cache().entries()])


def failure_reason(exc: Exception) -> str:
    """Why fetching the weights failed, in words for the replica's failure reason."""
    if isinstance(exc, InvalidToken):
        return ("this node cannot open the model's access token: its KVRUN_SEALING_KEY (or, "
                "without one, SECRET_KEY) differs from the control plane's")
    if isinstance(exc, HubRefusal):
        return exc.message
    return str(exc) or type(exc).__name__
