import re
import secrets
from datetime import datetime
from decimal import Decimal
from typing import Any

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import QuerySet

from accounts.models import LARGEST_LIMIT, Organization, Role, Scope
from accounts.services import validate_key_expiry
from billing.models import BudgetAction
from endpoints.models import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_IDLE_SECONDS,
    DEFAULT_LORA_RANK,
    LONGEST_WINDOW_SECONDS,
    LORA_RANKS,
    MAX_CONCURRENCY,
    MAX_DISK_TIER_GIB,
    MAX_HOST_TIER_GIB,
    MAX_LORA_ADAPTERS,
    MAX_LORA_HOST_ADAPTERS,
    MAX_REPLICAS_PER_ENDPOINT,
    MIN_CONTEXT_LENGTH,
    SHORTEST_WINDOW_SECONDS,
    Adapter,
    CacheIsolation,
    Endpoint,
    GPUType,
    KVCacheDtype,
    ModelSpec,
    Region,
    ScalingMetric,
    Task,
)
from endpoints.scheduling import Placement
from endpoints.selectors import engines_online, models_visible_to, regions_online
from endpoints.services import idle_time_refusal
from fleet.forms import NodeTokenFields


class APIKeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    scope = forms.ChoiceField(choices=Scope.choices, help_text="inference: /v1 only; manage: "
                              "also the REST API")
    endpoint_names = forms.CharField(
        required=False, label="Only these endpoints",
        help_text="Names separated by commas, an endpoint's adapter as endpoint:adapter; "
                  "empty: every endpoint of the organisation.")
    requests_per_minute = forms.IntegerField(required=False, min_value=1, max_value=LARGEST_LIMIT)
    tokens_per_minute = forms.IntegerField(required=False, min_value=1, max_value=LARGEST_LIMIT)
    expires_at = forms.DateTimeField(required=False, label="Expires at (UTC, optional)",
                                     widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    creation_token = forms.CharField(max_length=32, required=False, widget=forms.HiddenInput)

    def __init__(self, *args: object, endpoints: QuerySet[Endpoint], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.endpoints = endpoints
        self.fields["creation_token"].initial = secrets.token_urlsafe(16)
        for name, default in (("requests_per_minute", settings.KVRUN_KEY_REQUESTS_PER_MINUTE),
                              ("tokens_per_minute", settings.KVRUN_KEY_TOKENS_PER_MINUTE)):
            self.fields[name].help_text = f"Empty: the deployment's default, {default:,}."

    def clean_expires_at(self) -> datetime | None:
        validate_key_expiry(self.cleaned_data["expires_at"])
        return self.cleaned_data["expires_at"]

    def clean_creation_token(self) -> str | None:
        return self.cleaned_data["creation_token"] or None  # a form without one: no check

    def clean_endpoint_names(self) -> list[str]:
        names = sorted({name for name in re.split(r"[\s,]+", self.cleaned_data["endpoint_names"])
                        if name})
        known = set(self.endpoints.filter(name__in={name.partition(":")[0] for name in names})
                    .values_list("name", flat=True))
        known |= {f"{endpoint}:{adapter}" for endpoint, adapter in Adapter.objects.filter(
            endpoint__in=self.endpoints).values_list("endpoint__name", "name")}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValidationError(f"No endpoint or adapter named {', '.join(unknown)} in this "
                                  "organisation; check the names on the Endpoints page.")
        return names


class InviteForm(forms.Form):
    email = forms.EmailField(required=False, label="Email (optional)",
                             help_text="Only someone signed in with this address can accept "
                                       "the link (kvrun sends no mail); empty: anyone who has it.")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class OwnNodeForm(NodeTokenFields):
    """A join token for a node of the organisation's own."""

    region = forms.ModelChoiceField(queryset=Region.objects.all(), to_field_name="slug",
                                    required=False, empty_label="No region",
                                    help_text="Where the host is; the node cannot change it.")
    field_order = ["node_name", "region", "zone"]


class HubModelForm(forms.Form):
    """A model by its Hugging Face id (the wizard's "paste a Hugging Face id")."""

    hf_repo = forms.CharField(max_length=200, label="Hugging Face id",
                              widget=forms.TextInput(attrs={
                                  "placeholder": "meta-llama/Llama-3.1-8B-Instruct"}),
                              error_messages={"required": "Paste the model's id, owner/name."})
    hf_revision = forms.CharField(max_length=200, required=False, label="Revision (optional)",
                                  help_text="A branch, tag or commit; empty: the default "
                                            "branch. kvrun pins it to its commit.")
    hf_token = forms.CharField(max_length=400, required=False, label="Access token (optional)",
                               widget=forms.PasswordInput(render_value=False),
                               help_text="For a gated or private repository: a read token. "
                                         "Kept sealed; only its last four characters show.")


# The parser choices' first two values: the family's (the service's None) and none ("").
FAMILY_PARSER, NO_PARSER = "", "none"


class ModelFromHubForm(HubModelForm):
    """A model by its hub id, what it serves, and the parsers its engines start with: those
    the nodes that would run it offer."""

    task = forms.ChoiceField(
        required=False, label="Task", choices=[("", "What its config says"), *Task.choices],
        help_text="Embeddings from a generative checkpoint trained for them (Qwen3-Embedding) "
                  "need saying; rerankers and encoders say it themselves.")

    tool_call_parser = forms.ChoiceField(
        required=False, label="Tool-call parser",
        help_text="Needed for tools: without one its engines take no tools. Its family's: "
                  "where its tokenizer has the parser's markers.")
    reasoning_parser = forms.ChoiceField(
        required=False, label="Reasoning parser",
        help_text="Splits a reasoning model's thinking into each answer's reasoning field.")

    def __init__(self, *args: Any, organization: Organization, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        online = engines_online(organization_id=organization.id)
        for name, offered in (("tool_call_parser", online.tool_parsers),
                              ("reasoning_parser", online.reasoning_parsers)):
            self.fields[name].choices = [
                (FAMILY_PARSER, "Its family's"), (NO_PARSER, "None"),
                *((parser, parser) for parser in sorted(offered))]

    def choices(self) -> dict[str, str | None]:
        """The service's task and parsers: None for what its config says and its family's,
        "" for no parser."""
        return {"task": self.cleaned_data["task"] or None,
                **{name: None if self.cleaned_data[name] == FAMILY_PARSER
                   else "" if self.cleaned_data[name] == NO_PARSER else self.cleaned_data[name]
                   for name in ("tool_call_parser", "reasoning_parser")}}


class AdapterForm(HubModelForm):
    """A LoRA adapter of an endpoint, by its Hugging Face id."""

    name = forms.SlugField(max_length=63, label="Adapter name",
                           help_text="Clients call it as model \"endpoint:name\".",
                           error_messages={"invalid": "Use letters, digits and hyphens only, "
                                                      "such as legal-v2."})
    field_order = ["name", "hf_repo", "hf_revision", "hf_token"]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.fields["hf_repo"].widget.attrs["placeholder"] = "owner/my-lora"
        self.fields["hf_repo"].error_messages["required"] = "Paste the adapter's id, owner/name."


class AdapterUploadForm(forms.Form):
    """A LoRA adapter of an endpoint, from its two files."""

    name = AdapterForm.base_fields["name"]
    config = forms.FileField(label="adapter_config.json")
    weights = forms.FileField(label="adapter_model.safetensors")

    def __init__(self, *args: object, **kwargs: Any) -> None:
        # Beside AdapterForm on one page: ids of its own for the name both have.
        super().__init__(*args, auto_id="id_upload_%s", **kwargs)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        limit = settings.KVRUN_ADAPTER_UPLOAD_MIB * 1024 * 1024
        if sum(upload.size for upload in (data.get("config"), data.get("weights"))
               if upload is not None) > limit:
            raise ValidationError(f"The adapter's files take more than uploads may "
                                  f"({settings.KVRUN_ADAPTER_UPLOAD_MIB} MiB): publish it on "
                                  "the hub and add it by its id instead.")
        return data


class SizingForm(forms.Form):
    """What sizing needs; the wizard's live panel validates only these."""

    model = forms.ModelChoiceField(
        queryset=ModelSpec.objects.none(), to_field_name="slug", widget=forms.RadioSelect,
        error_messages={"required": "Pick a model from the catalog above.",
                        "invalid_choice": "That model is not in the catalog; pick one above."})
    context_length = forms.IntegerField(
        min_value=MIN_CONTEXT_LENGTH, initial=DEFAULT_CONTEXT_LENGTH,
        label="Context length (tokens)",
        help_text="The longest prompt plus answer one request may use.")
    concurrency = forms.IntegerField(min_value=1, max_value=MAX_CONCURRENCY,
                                     initial=DEFAULT_CONCURRENCY,
                                     label="Concurrent requests",
                                     help_text="Requests served at once at that context.")
    kv_cache_dtype = forms.ChoiceField(choices=KVCacheDtype.choices, initial=KVCacheDtype.AUTO,
                                       label="KV cache precision")
    prefix_caching = forms.BooleanField(required=False, initial=True,
                                        label="Prefix caching (reuse shared prompt prefixes)")
    gpu_type = forms.ModelChoiceField(
        queryset=GPUType.objects.all(), to_field_name="slug", required=False,
        empty_label="Cheapest that fits", label="Hardware")
    region = forms.ModelChoiceField(
        queryset=Region.objects.none(), to_field_name="slug", required=False,
        empty_label="Any region", label="Region",
        help_text="Its replicas run there alone, on the hardware online there.",
        error_messages={"invalid_choice": "No node is online in that region now; choose "
                                          "another, or any."})
    own_nodes_only = forms.BooleanField(
        required=False, label="On our own nodes only",
        help_text="Otherwise it runs on your own nodes first, then on shared ones.")
    host_tier_gib = forms.IntegerField(
        min_value=0, max_value=MAX_HOST_TIER_GIB, initial=0, required=False,
        label="Host-memory KV tier (GiB per replica)",
        help_text="Prefixes evicted from the device cache are kept in host memory (vLLM's "
                  "offloading). GPU nodes only; 0 for none.")
    disk_tier_gib = forms.IntegerField(
        min_value=0, max_value=MAX_DISK_TIER_GIB, initial=0, required=False,
        label="Disk KV tier (GiB per replica)",
        help_text="Beyond host memory, on the node's disk (LMCache; needs a host tier). GPU "
                  "nodes only; 0 for none.")

    lora_adapters = forms.IntegerField(
        min_value=0, max_value=MAX_LORA_ADAPTERS, initial=0, required=False,
        label="LoRA adapters on the device at once",
        help_text="Fine-tunes of this model served beside it (model \"endpoint:adapter\"); "
                  "each slot takes device memory at the largest rank. 0 for none.")
    lora_max_rank = forms.TypedChoiceField(
        choices=[(rank, rank) for rank in LORA_RANKS], coerce=int, initial=DEFAULT_LORA_RANK,
        required=False, empty_value=DEFAULT_LORA_RANK, label="Largest adapter rank")

    def __init__(self, *args: object, organization: Organization, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # The public catalog and the organisation's own models; nobody else's.
        self.fields["model"].queryset = models_visible_to(organization=organization)
        self.fields["region"].queryset = regions_online(organization_id=organization.id)
        self.organization = organization
        if not organization.nodes.exists():  # offered to organisations with nodes of their own
            del self.fields["own_nodes_only"]

    def placement(self) -> Placement:
        """Where, by the form's cleaned data, the endpoint would run."""
        return Placement(region=self.cleaned_data["region"],
                         organization_id=self.organization.id,
                         own_nodes_only=self.cleaned_data.get("own_nodes_only", False))

    def clean_host_tier_gib(self) -> int:
        return self.cleaned_data["host_tier_gib"] or 0

    def clean_disk_tier_gib(self) -> int:
        return self.cleaned_data["disk_tier_gib"] or 0

    def clean_lora_adapters(self) -> int:
        return self.cleaned_data["lora_adapters"] or 0


class KVRoutingFields(forms.Form):
    cache_isolation = forms.ChoiceField(
        choices=CacheIsolation.choices, initial=CacheIsolation.ORGANIZATION, required=False,
        label="Cached prefixes are shared",
        help_text="Within the organisation, or only within each API key.")
    prefix_affinity = forms.BooleanField(
        required=False, initial=True, label="Prefix-affinity routing",
        help_text="With two or more replicas, requests that share a prompt prefix go to the "
                  "replica that has it cached.")


    def clean_cache_isolation(self) -> str:
        return self.cleaned_data["cache_isolation"] or CacheIsolation.ORGANIZATION


class EndpointForm(SizingForm, KVRoutingFields):
    name = forms.SlugField(max_length=63,
                           help_text="Clients send it as \"model\" in their requests.",
                           error_messages={"invalid": "Use letters, digits and hyphens only, "
                                                      "such as support-chat."})
    min_replicas = forms.IntegerField(
        min_value=0, max_value=MAX_REPLICAS_PER_ENDPOINT, initial=1, label="Fewest replicas",
        help_text="0 scales to zero when idle (no GPU time billed); the next request waits "
                  "for a replica to start.")
    max_replicas = forms.IntegerField(min_value=1, max_value=MAX_REPLICAS_PER_ENDPOINT,
                                      required=False,
                                      label="Most replicas (for scaling)")
    scale_to_zero_after_seconds = forms.IntegerField(
        min_value=1, initial=DEFAULT_IDLE_SECONDS, required=False,
        label="Idle time before zero (s)",
        help_text="With fewest replicas 0: how long without a request before it scales to zero.")
    lora_host_adapters = forms.IntegerField(
        min_value=0, max_value=MAX_LORA_HOST_ADAPTERS, initial=0, required=False,
        label="LoRA adapters kept in host memory",
        help_text="Ready to swap onto the device without reading them again; 0: as many as "
                  "on the device.")

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        _show_idle_floor(self)

    def clean_lora_host_adapters(self) -> int:
        return self.cleaned_data["lora_host_adapters"] or 0


def _refuse_idle_time(seconds: int) -> None:
    refusal = idle_time_refusal(seconds)
    if refusal:
        raise ValidationError(refusal)


def _show_idle_floor(form: forms.Form) -> None:
    """The shortest idle time before zero, in the field's help and as its least value: the
    browser says so before a submit, and the form with its other fields' errors (the service
    checks it too, for the API; settings may change it)."""
    shortest = settings.KVRUN_SCALE_TO_ZERO_MIN_SECONDS
    field = form.fields["scale_to_zero_after_seconds"]
    field.widget.attrs["min"] = shortest
    field.validators.append(_refuse_idle_time)
    field.help_text = f"{field.help_text} At least {shortest} s."


class PolicyForm(KVRoutingFields):
    """An endpoint's KV policy, changed on its hardware."""

    context_length = forms.IntegerField(min_value=MIN_CONTEXT_LENGTH,
                                        label="Context length (tokens)")
    concurrency = forms.IntegerField(min_value=1, max_value=MAX_CONCURRENCY,
                                     label="Concurrent requests")
    kv_cache_dtype = SizingForm.base_fields["kv_cache_dtype"]
    prefix_caching = SizingForm.base_fields["prefix_caching"]
    host_tier_gib = SizingForm.base_fields["host_tier_gib"]
    disk_tier_gib = SizingForm.base_fields["disk_tier_gib"]
    lora_adapters = SizingForm.base_fields["lora_adapters"]
    lora_max_rank = SizingForm.base_fields["lora_max_rank"]
    lora_host_adapters = EndpointForm.base_fields["lora_host_adapters"]
    clean_host_tier_gib = SizingForm.clean_host_tier_gib
    clean_disk_tier_gib = SizingForm.clean_disk_tier_gib
    clean_lora_adapters = SizingForm.clean_lora_adapters
    clean_lora_host_adapters = EndpointForm.clean_lora_host_adapters

    @classmethod
    def of(cls, endpoint: Endpoint) -> "PolicyForm":
        return cls(initial={name: getattr(endpoint, name) for name in cls.base_fields})


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=1, label="Replicas")


WINDOW_RANGE = {"min": SHORTEST_WINDOW_SECONDS, "max": LONGEST_WINDOW_SECONDS}


class ScalingForm(forms.Form):
    """How an endpoint scales (endpoints.services.do_change_endpoint_scaling checks the rest)."""

    min_replicas = forms.IntegerField(
        min_value=0, max_value=MAX_REPLICAS_PER_ENDPOINT, label="Fewest replicas",
        help_text="0 scales to zero while idle; the next request wakes it and waits.")
    max_replicas = forms.IntegerField(min_value=1, max_value=MAX_REPLICAS_PER_ENDPOINT,
                                      label="Most replicas")
    scale_to_zero_after_seconds = forms.IntegerField(
        min_value=1, label="Idle time before zero (s)",
        help_text="With 0 fewest: how long without a request before its replicas stop.")
    scaling_metric = forms.ChoiceField(choices=ScalingMetric.choices, label="Scale on")
    scaling_target = forms.FloatField(
        required=False, min_value=0.01, label="Target per replica",
        help_text="Empty: the concurrency, 1 waiting, or 90 % of the KV cache.")
    # The service checks the windows' range; the browser is told it too.
    scale_up_window_seconds = forms.IntegerField(label="Up after (s) above target",
                                                 widget=forms.NumberInput(attrs=WINDOW_RANGE))
    scale_down_window_seconds = forms.IntegerField(label="Down after (s) under target",
                                                   widget=forms.NumberInput(attrs=WINDOW_RANGE))

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        _show_idle_floor(self)

    @classmethod
    def of(cls, endpoint: Endpoint) -> "ScalingForm":
        return cls(initial={name: getattr(endpoint, name) for name in cls.base_fields})


class BudgetForm(forms.Form):
    monthly_limit_usd = forms.DecimalField(
        label="Monthly limit (USD)", min_value=Decimal("0.01"), max_digits=12, decimal_places=2)
    thresholds = forms.CharField(
        initial="50, 80, 100", help_text="Percentages of the limit that record an alert, "
                                         "separated by commas.")
    action = forms.ChoiceField(choices=BudgetAction.choices, label="At 100 %",
                               initial=BudgetAction.ALERT)

    def clean_thresholds(self) -> list[int]:
        parts = [part for part in re.split(r"[\s,%]+", self.cleaned_data["thresholds"]) if part]
        # isdigit alone takes "²" and numbers int() refuses for their length.
        if not parts or not all(part.isascii() and part.isdigit() and len(part) <= 9
                                for part in parts):
            raise ValidationError("Give whole percentages separated by commas, such as "
                                  "50, 80, 100.")
        return [int(part) for part in parts]

    @property
    def monthly_limit_cents(self) -> int:
        return int(self.cleaned_data["monthly_limit_usd"] * 100)
