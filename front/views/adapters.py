"""An endpoint's LoRA adapters, added from the hub or by upload and removed, from its page."""

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_POST

from endpoints import services
from endpoints.models import Endpoint
from endpoints.selectors import adapters_of
from front.forms import AdapterForm, AdapterUploadForm
from front.scoping import Member
from front.views.shared import change_endpoint, change_settings


@login_required
@require_POST
def add_adapter(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def add(member: Member, endpoint: Endpoint, values: dict[str, Any]) -> str:
        adapter = services.do_add_adapter_from_hub(
            endpoint=endpoint, actor_role=member.role, added_by=request.user,
            name=values["name"], repo_id=values["hf_repo"], revision=values["hf_revision"],
            token=values["hf_token"])
        return _added(endpoint, adapter.name, f"{adapter.hf_repo}, pinned at commit "
                                              f"{adapter.hf_commit[:12]}")
    return change_settings(request, org_slug, name, AdapterForm(request.POST), add)


@login_required
@require_POST
def upload_adapter(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    def add(member: Member, endpoint: Endpoint, values: dict[str, Any]) -> str:
        adapter = services.do_add_adapter_from_upload(
            endpoint=endpoint, actor_role=member.role, added_by=request.user,
            name=values["name"], config_json=values["config"].read(),
            weights=values["weights"].read())
        return _added(endpoint, adapter.name, "the uploaded files")
    return change_settings(request, org_slug, name,
                           AdapterUploadForm(request.POST, request.FILES), add)


@login_required
@require_POST
def remove_adapter(request: HttpRequest, org_slug: str, name: str, adapter: str) -> HttpResponse:
    def remove(member: Member, endpoint: Endpoint) -> str:
        found = adapters_of(endpoint=endpoint).filter(name=adapter).first()
        if found is None:
            return f"{endpoint.name} has no adapter {adapter!r} (removed already?)."
        services.do_remove_adapter(adapter=found, actor_role=member.role)
        return (f"Adapter {adapter} removed: requests for {endpoint.name}:{adapter} get "
                "model_not_found within seconds. Its usage stays on record.")
    return change_endpoint(request, org_slug, name, remove)


def _added(endpoint: Endpoint, adapter: str, source: str) -> str:
    return (f"Adapter {adapter} added from {source}. Its running replicas load it within "
            f"seconds, without a restart; clients call it as model "
            f"\"{endpoint.name}:{adapter}\".")
