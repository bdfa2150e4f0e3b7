"""LoRA adapters an endpoint serves beside its model: added from the hub or by upload, judged
against the endpoint before anything is kept, and removed."""

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from accounts.models import User
from accounts.services import require_manager
from endpoints import dispatch
from endpoints.models import Adapter, AdapterFile, AdapterSource, Endpoint, EndpointEvent
from endpoints.planning import lora_shape_of
from endpoints.services.hub_models import TOKEN_SHAPE
from engine import hub, lora
from kvrun.common.sealing import seal

REPEATED = "one_adapter_name_per_endpoint"


def do_add_adapter_from_hub(*, endpoint: Endpoint, actor_role: str | None,
                            added_by: User | None, name: str, repo_id: str,
                            revision: str = "", token: str = "") -> Adapter:
    """Add the hub repository `repo_id` at `revision` (the default branch when empty) as the
    LoRA adapter `name` of `endpoint`, pinned to the commit it resolves to now. Its running
    replicas load it without a restart; replicas started later load it as they start.

    Raises ValidationError keyed by the field to change, and changes nothing, when the
    endpoint serves no adapters, the name is taken, the repository cannot be read with the
    token, is not a LoRA adapter, or does not fit the endpoint (engine.lora.admit: its base
    model, its rank against the endpoint's largest, its target modules and tensor shapes).
    The token, when given, is kept sealed for the downloads."""
    require_manager(actor_role, "add adapters")
    repo_id, revision, token = repo_id.strip(), revision.strip(), token.strip()
    _refuse_without_lora(endpoint)
    if token and not TOKEN_SHAPE.fullmatch(token):
        raise ValidationError({"hf_token": [
            "An access token is letters, digits and punctuation without spaces (hf_…); paste "
            "it again from the hub's settings."]})
    try:
        found = hub.inspect_adapter(endpoint=settings.KVRUN_HUB_URL, repo_id=repo_id,
                                    revision=revision or None, token=token or None)
    except hub.HubRefusal as exc:
        raise ValidationError({exc.field: [exc.message]}) from exc
    config = _admitted(endpoint, found.config, found.tensors, field="hf_repo")
    adapter = Adapter(
        endpoint=endpoint, name=name, source=AdapterSource.HUB, hf_repo=repo_id,
        hf_revision=revision, hf_commit=found.commit,
        files=[asdict(f) for f in found.files], hf_token_sealed=seal(token) if token else "",
        hf_token_last4=token[-4:], base_model=config.base_model, rank=config.rank,
        target_modules=list(config.target_modules),
        size_bytes=sum(f.size for f in found.files), added_by=added_by)
    return _insert(adapter, uploads={})


def do_add_adapter_from_upload(*, endpoint: Endpoint, actor_role: str | None,
                               added_by: User | None, name: str, config_json: bytes,
                               weights: bytes) -> Adapter:
    """Add an uploaded LoRA adapter (its adapter_config.json and adapter_model.safetensors)
    as `name` of `endpoint`, as do_add_adapter_from_hub does. Raises ValidationError keyed by
    the field to change: files over KVRUN_ADAPTER_UPLOAD_MIB, a config that is not JSON, or
    an adapter that does not fit the endpoint."""
    require_manager(actor_role, "add adapters")
    _refuse_without_lora(endpoint)
    limit = settings.KVRUN_ADAPTER_UPLOAD_MIB * 1024 * 1024
    if len(config_json) + len(weights) > limit:
        raise ValidationError({"weights": [
            f"The adapter's files take {(len(config_json) + len(weights)) / 2**20:.1f} MiB, "
            f"more than uploads may ({settings.KVRUN_ADAPTER_UPLOAD_MIB} MiB): publish it "
            "on the hub and add it by its id instead."]})
    try:
        stated = json.loads(config_json)
    except ValueError as exc:
        raise ValidationError({"config": [f"{lora.CONFIG_FILE} is not JSON ({exc})."]}) from exc
    if not isinstance(stated, dict):
        raise ValidationError({"config": [f"{lora.CONFIG_FILE} must be a JSON object."]})
    try:
        tensors = lora.read_header(weights)
    except lora.AdapterRefusal as exc:
        raise ValidationError({"weights": [str(exc)]}) from exc
    config = _admitted(endpoint, stated, tensors, field="weights")
    uploads = {lora.CONFIG_FILE: config_json, lora.WEIGHTS_FILE: weights}
    adapter = Adapter(
        endpoint=endpoint, name=name, source=AdapterSource.UPLOAD,
        files=[{"path": path, "size": len(content),
                "sha256": hashlib.sha256(content).hexdigest()}
               for path, content in uploads.items()],
        base_model=config.base_model, rank=config.rank,
        target_modules=list(config.target_modules), size_bytes=len(config_json) + len(weights),
        added_by=added_by)
    return _insert(adapter, uploads=uploads)


def do_remove_adapter(*, adapter: Adapter, actor_role: str | None) -> None:
    """Stop serving `adapter`: its replicas unload it (requests naming it get
    model_not_found within the gateway's route cache), and its row and uploaded files go.
    Its usage records keep its name."""
    require_manager(actor_role, "remove adapters")
    endpoint = adapter.endpoint
    with transaction.atomic():
        deleted, _ = Adapter.objects.filter(id=adapter.id).delete()
        if deleted:
            EndpointEvent.objects.create(endpoint=endpoint, state=endpoint.state,
                                         message=f"adapter {adapter.name} removed")
            dispatch.wake_adapter_servers_after_commit(endpoint=endpoint)


def _refuse_without_lora(endpoint: Endpoint) -> None:
    if not endpoint.lora_adapters:
        raise ValidationError({"name": [
            f"Endpoint {endpoint.name} serves no LoRA adapters: set how many it holds at once "
            "(lora_adapters, in its KV policy; its replicas restart once) and add the adapter "
            "again."]})


def _admitted(endpoint: Endpoint, stated: Mapping[str, Any], tensors: Mapping[str, list[int]],
              *, field: str) -> lora.AdapterConfig:
    """The adapter's config once engine.lora.admit finds it fits `endpoint`."""
    model = endpoint.model
    shape = lora_shape_of(model)
    assert shape is not None, "an endpoint with LoRA slots has a model of known shape"
    try:
        config = lora.AdapterConfig.of(stated)
        lora.admit(config, tensors, shape=shape, max_rank=endpoint.lora_max_rank,
                   base_names=tuple(name for name in (model.hf_repo, model.slug, model.name)
                                    if name))
    except lora.AdapterRefusal as exc:
        raise ValidationError({field: [str(exc)]}) from exc
    return config


def _insert(adapter: Adapter, *, uploads: Mapping[str, bytes]) -> Adapter:
    try:
        adapter.full_clean(exclude=["endpoint", "files", "target_modules", "added_by"])
    except ValidationError as exc:
        # The name is the person's; the rest came from the adapter's files or repository.
        source = "hf_repo" if adapter.source == AdapterSource.HUB else "config"
        raise ValidationError({("name" if field == "name" else source): messages
                               for field, messages in exc.message_dict.items()}) from exc
    try:
        with transaction.atomic():
            adapter.save(force_insert=True)
            AdapterFile.objects.bulk_create(
                AdapterFile(adapter=adapter, path=path, content=content,
                            sha256=hashlib.sha256(content).hexdigest())
                for path, content in uploads.items())
            source = adapter.hf_repo or "an upload"
            EndpointEvent.objects.create(
                endpoint=adapter.endpoint, state=adapter.endpoint.state,
                message=f"adapter {adapter.name} added from {source} (rank {adapter.rank}, "
                        f"{', '.join(adapter.target_modules)}); served as "
                        f"{adapter.endpoint.name}:{adapter.name}")
            dispatch.wake_adapter_servers_after_commit(endpoint=adapter.endpoint)
    except IntegrityError as exc:
        if REPEATED in str(exc):
            raise ValidationError({"name": [
                f"Endpoint {adapter.endpoint.name} already has an adapter named "
                f"{adapter.name!r}; choose another name, or remove that one first."]}) from exc
        raise
    return adapter
