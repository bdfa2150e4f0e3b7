"""The create-endpoint wizard: pick a model from the catalog, size it live, launch it.

The catalog list and the sizing panel are partials that htmx swaps in as the person types;
the launch posts the whole form, and errors come back next to their fields.
"""

import re
from decimal import Decimal
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from accounts.models import Organization
from endpoints import planning, services
from endpoints.models import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_IDLE_SECONDS,
    GPUType,
    ModelSpec,
    Task,
)
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.scheduling import Placement
from endpoints.selectors import median_start_seconds, models_visible_to
from front import presenters
from front.forms import EndpointForm, ModelFromHubForm, SizingForm
from front.scoping import Member, membership
from kvrun.common.forms import add_service_errors

# Catalog filters: parameter-count bands and minimum contexts a person can pick.
SIZES = {"small": (0, 4e9), "medium": (4e9, 16e9), "large": (16e9, 100e9), "huge": (100e9, 1e15)}
SIZE_LABELS = {"small": "under 4B", "medium": "4–16B", "large": "16–100B", "huge": "over 100B"}
CONTEXTS = [8192, 32768, 131072]
RUNS_ONLINE_CONTEXT = 2048


@login_required
def new_endpoint(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = membership(request, org_slug)
    if not member.manages:
        messages.error(request, "Only owners and admins can create endpoints; ask one of them.")
        return redirect("endpoints", org_slug=org_slug)
    organization = member.organization
    if request.method != "POST":
        return _page(request, member, EndpointForm(
            initial=_initial(request.GET, organization), organization=organization))
    form = EndpointForm(request.POST, organization=organization)
    if not form.is_valid():
        return _page(request, member, form, status=400)
    data = form.cleaned_data
    try:
        endpoint = services.do_create_endpoint(
            organization=member.organization, actor_role=member.role, created_by=request.user,
            name=data["name"], model=data["model"], gpu_type=data["gpu_type"],
            region=data["region"], own_nodes_only=data.get("own_nodes_only", False),
            policy=EndpointPolicy.from_values(data),
            scaling=EndpointScaling.from_values(data))
    except ValidationError as exc:  # Unfit included: the sizing panel shows its advice
        add_service_errors(form, exc)
        return _page(request, member, form, status=400)
    return redirect("endpoint", org_slug=org_slug, name=endpoint.name)


@login_required
@require_POST
def sizing(request: HttpRequest, org_slug: str) -> HttpResponse:
    """The live sizing panel for what the form holds now (htmx partial)."""
    member = membership(request, org_slug)
    return render(request, "front/_sizing.html", _sizing_context(
        SizingForm(request.POST, organization=member.organization)))


@login_required
@require_POST
def add_model(request: HttpRequest, org_slug: str) -> HttpResponse:
    """Add a model by its Hugging Face id, then show the wizard with it chosen and sized."""
    member = membership(request, org_slug)
    hub_form = ModelFromHubForm(request.POST, organization=member.organization)
    if hub_form.is_valid():
        data = hub_form.cleaned_data
        try:
            model = services.do_add_model_from_hub(
                organization=member.organization, actor_role=member.role,
                added_by=request.user, repo_id=data["hf_repo"], revision=data["hf_revision"],
                token=data["hf_token"], **hub_form.choices())
        except ValidationError as exc:
            add_service_errors(hub_form, exc)
        else:
            messages.success(request, f"Added {model.hf_repo}, pinned at commit "
                                      f"{model.hf_commit[:12]}; it is sized below.")
            return redirect(f"{reverse('endpoint-new', args=[org_slug])}?"
                            f"{urlencode({'model': model.slug})}")
    form = EndpointForm(initial=_initial(QueryDict(), member.organization),
                        organization=member.organization)
    return _page(request, member, form, hub_form=hub_form, status=400)


def _page(request: HttpRequest, member: Member, form: EndpointForm, *,
          hub_form: ModelFromHubForm | None = None, status: int = 200) -> HttpResponse:
    values = form.data if form.is_bound else QueryDict(mutable=True)
    if not form.is_bound:
        values.update({name: str(value) for name, value in form.initial.items()})
    organization = member.organization
    context = {"member": member, "organization": organization, "form": form,
               "hub_form": hub_form or ModelFromHubForm(organization=organization),
               "section": "endpoints",
               "selected": values.get("model", ""), **_catalog_context(organization)}
    if form.is_bound or form.initial.get("model"):
        context.update(_sizing_context(SizingForm(values, organization=organization)))
        advice = context.get("advice")
        if form.is_bound and advice and advice.field in form.fields and not form.has_error(
                advice.field):
            # Refused for another field too: say at once that the sizing will not fit either.
            form.add_error(advice.field, advice.message)
    return render(request, "front/endpoint_new.html", context, status=status)


def _initial(query: QueryDict, organization: Organization) -> dict[str, object]:
    initial: dict[str, object] = {"context_length": DEFAULT_CONTEXT_LENGTH,
                                  "concurrency": DEFAULT_CONCURRENCY,
                                  "kv_cache_dtype": "auto", "prefix_caching": True,
                                  "host_tier_gib": 0, "disk_tier_gib": 0,
                                  "cache_isolation": "organization", "prefix_affinity": True,
                                  "min_replicas": 1,
                                  "scale_to_zero_after_seconds": DEFAULT_IDLE_SECONDS}
    model = models_visible_to(organization=organization).filter(
        slug=query.get("model", "")).first()
    if model is not None:
        initial.update(model=model.slug, name=suggested_name(model.slug),
                       context_length=min(DEFAULT_CONTEXT_LENGTH, model.max_context))
    return initial


def suggested_name(slug: str) -> str:
    """An endpoint name from a model's slug (an organisation's own model: its name, without
    the organisation): a slug itself (no dots), at most 40 characters."""
    return re.sub(r"[^a-z0-9-]+", "-", slug.split("--")[-1].lower())[:40].strip("-")


def _catalog_context(organization: Organization) -> dict[str, object]:
    """Every model the organisation may pick (its own first) with what the page filters on,
    and whether a node online serves it one request of a useful length
    (RUNS_ONLINE_CONTEXT tokens, or its maximum if less); the filtering happens in the
    browser, so a choice never races a re-rendered list."""
    models = list(models_visible_to(organization=organization))
    runs_online = {model.id for model in planning.models_that_fit_online(
        models=models, context_length=RUNS_ONLINE_CONTEXT, concurrency=1,
        kv_cache_dtype="auto", placement=Placement(organization_id=organization.id))}
    # Stable: catalog order within each group.
    models.sort(key=lambda model: (model.organization_id is None, model.id not in runs_online))
    return {
        "models": [{"spec": model, "size": _size_of(model), "runs_online": model.id in runs_online}
                   for model in models],
        "sizes": SIZE_LABELS, "contexts": CONTEXTS, "tasks": Task.choices,
        "licences": sorted({model.licence for model in models}),
    }


def _size_of(model: ModelSpec) -> str:
    return next(name for name, (low, high) in SIZES.items() if low <= model.parameters < high)


def _sizing_context(form: SizingForm) -> dict[str, object]:
    if not form.is_valid():
        return {"sizing_form": form}
    data = form.cleaned_data
    model = data["model"]
    asked = {"model": model, "context_length": data["context_length"],
             "concurrency": data["concurrency"], "kv_cache_dtype": data["kv_cache_dtype"]}
    if data["context_length"] > model.max_context:
        return {"sizing_form": form, "too_long": model.max_context}
    try:
        decided = planning.plan(**asked, gpu_type=data["gpu_type"], placement=form.placement(),
                                host_tier_gib=data["host_tier_gib"],
                                disk_tier_gib=data["disk_tier_gib"],
                                lora_adapters=data["lora_adapters"],
                                lora_max_rank=data["lora_max_rank"])
        planning.check_tiers(host_tier_gib=data["host_tier_gib"],
                             disk_tier_gib=data["disk_tier_gib"], gpu_type=decided.gpu_type,
                             gpu_count=decided.gpu_count, placement=form.placement())
    except planning.Unfit as exc:
        return {"sizing_form": form, "advice": exc.advice}
    except ValidationError as exc:  # a KV tier the hardware's engine cannot use, a region
        return {"sizing_form": form, "refusals": exc.message_dict}
    summary = decided.summary
    device = planning.accelerator_of(decided.gpu_type).memory_bytes
    other_dtype = "fp8" if data["kv_cache_dtype"] == "auto" else "auto"
    monthly = Decimal(summary["hourly_price_usd"]) * HOURS_PER_MONTH
    return {
        "sizing_form": form, "plan": decided, "summary": summary,
        "daily_price": Decimal(summary["hourly_price_usd"]) * 24,
        "monthly_price": monthly, "idle_share": IDLE_SHARE,
        "monthly_price_scaled_to_zero": monthly * (1 - IDLE_SHARE),
        "wake_seconds": median_start_seconds(model_id=model.id,
                                             gpu_type_id=decided.gpu_type.id),
        "memory": presenters.memory_bar(summary, device, task=model.task),
        "batch_tokens": data["context_length"] * data["concurrency"],
        "keeps_kv_cache": planning.shape_of(model).kv_cache,
        "device_bytes": device,
        "other_dtype": other_dtype,
        "other_dtype_concurrency": planning.largest_concurrency_on(
            model=model, context_length=data["context_length"], kv_cache_dtype=other_dtype,
            gpu_type=decided.gpu_type, gpu_count=decided.gpu_count),
        "alternatives": _alternatives(summary["alternatives"]),
    }


# The month a price is quoted for (365 × 24 / 12 hours), and the idle share at which the
# wizard shows what scaling to zero would save: a working-hours endpoint is idle about half
# the time.
HOURS_PER_MONTH = 730
IDLE_SHARE = Decimal("0.5")


def _alternatives(rows: list[dict]) -> list[dict[str, object]]:
    types = {gpu.slug: gpu for gpu in GPUType.objects.filter(slug__in=[r["gpu_type"]
                                                                        for r in rows])}
    return [{**row, "gpu": types[row["gpu_type"]]} for row in rows if row["gpu_type"] in types]
