"""The operators' console for the usage ledger: read only, and fast over millions of rows.

Django's default list filters for a plain column run SELECT DISTINCT over the whole table,
and its search runs substring matches on every row; here both use fixed choices and exact
matches on indexed columns instead, and the list counts at most BoundedCountPaginator's limit.
"""

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import HttpRequest

from accounts.models import Organization
from billing.models import (
    BillingAccount,
    Budget,
    BudgetEvent,
    GPUHour,
    GPUPrice,
    Invoice,
    InvoiceLine,
    RollupState,
    StripeEvent,
    TokenHour,
    TokenPrice,
    UsageRecord,
)
from billing.money import usd
from billing.payments import do_clear_delinquency
from billing.rollup import do_write_down_list_prices
from billing.selectors import RollupLag, rollup_lag
from endpoints.models import Endpoint
from engine import tasks
from kvrun.common.paginators import BoundedCountPaginator


class LedgerAdmin(admin.ModelAdmin):
    """Ledger rows and what is derived from them: written by kvrun alone, never changed here."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class StatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"
    CLASSES = {
        "2xx": Q(status_code__gte=200, status_code__lt=300),
        "4xx": Q(status_code__gte=400, status_code__lt=500) & ~Q(status_code__in=[429, 499]),
        "429": Q(status_code=429),
        "499": Q(status_code=499),
        "5xx": Q(status_code__gte=500),
    }

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple]:
        return [("2xx", "2xx: served"), ("4xx", "4xx other than 429 and 499"),
                ("429", "429: rate limited"), ("499", "499: client went away"),
                ("5xx", "5xx: engine or gateway error")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        chosen = self.CLASSES.get(self.value() or "")
        return queryset.filter(chosen) if chosen is not None else queryset


class OperationFilter(admin.SimpleListFilter):
    title = "operation"
    parameter_name = "operation"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple]:
        # The operations the gateway meters.
        return [(operation, operation) for operation in sorted(tasks.ALL_OPERATIONS)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(operation=self.value()) if self.value() else queryset


@admin.register(UsageRecord)
class UsageRecordAdmin(LedgerAdmin):
    list_display = ["request_id", "organization", "endpoint", "key", "operation", "status_code",
                    "tokens", "time_to_first_token_ms", "duration_ms", "started_at"]
    list_filter = [StatusFilter, OperationFilter, "stream", "client_disconnected", "started_at"]
    search_fields = ["request_id", "organization__slug", "endpoint__name"]
    search_help_text = "A request id, an organisation's slug or an endpoint's name, exactly."
    list_select_related = ["organization", "endpoint", "api_key"]
    ordering = ["-id"]  # newest first along the primary key, not a sort of the whole table
    paginator = BoundedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # a COUNT per filter choice, each over the ledger
    fields = ["request_id", "idempotency_key", "organization", "endpoint", "replica", "key",
              "operation", "stream", "prompt_tokens", "completion_tokens", "cached_tokens",
              "status_code", "error_code", "client_disconnected", "started_at",
              "time_to_first_token_ms", "duration_ms", "gateway_overhead_ms", "adapter",
              "ingested_at"]
    readonly_fields = fields


    def get_search_results(self, request: HttpRequest, queryset: QuerySet[UsageRecord],
                           search_term: str) -> tuple[QuerySet[UsageRecord], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        # Ids found first, so PostgreSQL sees constants and ORs three index scans.
        organizations = list(Organization.objects.filter(slug=term).values_list("id", flat=True))
        endpoints = list(Endpoint.objects.filter(name=term).values_list("id", flat=True))
        return queryset.filter(Q(request_id=term) | Q(organization_id__in=organizations)
                               | Q(endpoint_id__in=endpoints)), False

    @admin.display(description="API key")
    def key(self, record: UsageRecord) -> str:
        return record.api_key.masked if record.api_key else ""

    @admin.display(description="tokens (prompt + completion)")
    def tokens(self, record: UsageRecord) -> str:
        return f"{record.prompt_tokens} + {record.completion_tokens}"


class RollupAdmin(LedgerAdmin):
    """Hourly lines the rollup derives from the ledger: read only, rewritten by it alone."""

    list_select_related = ["organization", "endpoint"]
    search_fields = ["=endpoint__name", "=organization__slug"]
    search_help_text = "An endpoint's name or an organisation's slug, exactly."
    ordering = ["-hour", "-id"]
    list_filter = ["hour"]
    paginator = BoundedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER



@admin.register(TokenHour)
class TokenHourAdmin(RollupAdmin):
    list_display = ["hour", "organization", "endpoint", "api_key", "requests", "prompt_tokens",
                    "completion_tokens", "cached_tokens"]
    list_select_related = ["organization", "endpoint", "api_key"]


@admin.register(GPUHour)
class GPUHourAdmin(RollupAdmin):
    list_display = ["hour", "organization", "endpoint", "gpu_type", "phase", "gpu_seconds"]
    list_filter = ["hour", "phase", "gpu_type"]
    list_select_related = ["organization", "endpoint", "gpu_type"]


@admin.register(RollupState)
class RollupStateAdmin(LedgerAdmin):
    """How far the token rollup lags behind the ledger, and the size of its batches: one row,
    written by the rollup alone."""

    list_display = ["batches", "stale_hours", "oldest_stale_hour", "lag", "timed_out_at",
                    "timeout_reason"]
    list_display_links = None
    fields = ["batch_hours", "timed_out_at", "timeout_reason"]
    readonly_fields = fields

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None
                        ) -> object:
        # The row the rollup writes, there before its first run: the lag is shown from the
        # first visit.
        RollupState.objects.get_or_create(id=1)
        return super().changelist_view(request, extra_context)

    @staticmethod
    def lag_of(state: RollupState) -> RollupLag:
        """Read once per row shown (there is one), kept on the row."""
        if not hasattr(state, "lag"):
            state.lag = rollup_lag()
        return state.lag

    @admin.display(description="batch size")
    def batches(self, state: RollupState) -> str:
        return f"{state.batch_hours:,} stale hours"

    @admin.display(description="stale hours")
    def stale_hours(self, state: RollupState) -> str:
        return f"{self.lag_of(state).stale_hours:,}"

    @admin.display(description="oldest stale hour")
    def oldest_stale_hour(self, state: RollupState) -> str:
        oldest = self.lag_of(state).oldest_hour
        return f"{oldest:%Y-%m-%d %H:00} UTC" if oldest else "none"

    @admin.display(description="longest wait")
    def lag(self, state: RollupState) -> str:
        return f"{self.lag_of(state).lag_seconds():,.0f} s"


class PriceAdmin(admin.ModelAdmin):
    """Prices are versions: an operator adds one that starts at a future hour; none is ever
    changed or deleted, so a past hour keeps the price it ran at."""

    readonly_fields = ["created_at"]

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(GPUPrice)
class GPUPriceAdmin(PriceAdmin):
    list_display = ["gpu_type", "scope", "hourly_price_usd", "effective_from", "created_at"]
    list_filter = ["gpu_type", "own_nodes", "region"]
    list_select_related = ["gpu_type", "region"]
    fields = ["gpu_type", "region", "own_nodes", "hourly_price_usd", "effective_from",
              "created_at"]

    @admin.display(description="where")
    def scope(self, price: GPUPrice) -> str:
        if price.own_nodes:
            return "organisations' own nodes"
        return price.region.name if price.region else "general"

    def save_model(self, request: HttpRequest, obj: GPUPrice, form: object,
                   change: bool) -> None:
        do_write_down_list_prices()  # the hours before the new price keep the list price
        super().save_model(request, obj, form, change)


@admin.register(TokenPrice)
class TokenPriceAdmin(PriceAdmin):
    list_display = ["model", "prompt_per_million_usd", "cached_per_million_usd",
                    "completion_per_million_usd", "effective_from", "created_at"]
    list_filter = ["model"]
    fields = ["model", "prompt_per_million_usd", "cached_per_million_usd",
              "completion_per_million_usd", "effective_from", "created_at"]


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    fields = ["description", "kind", "usage_month", "adjustment", "quantity", "unit",
              "unit_price_usd", "amount_cents"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(LedgerAdmin):
    """Finalised invoices: ledger rows, read only."""

    list_display = ["number", "organization", "month", "total", "finalized_at"]
    list_select_related = ["organization"]
    search_fields = ["=number", "=organization__slug"]
    search_help_text = "An invoice number or an organisation's slug, exactly."
    list_filter = ["month"]
    fields = ["number", "organization", "month", "currency", "total", "finalized_at"]
    readonly_fields = fields
    inlines = [InvoiceLineInline]


    @admin.display(description="total")
    def total(self, invoice: Invoice) -> str:
        return usd(invoice.total_cents)


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    """Operators may set a budget for an organisation; the next check applies it."""

    list_display = ["organization", "limit", "thresholds", "action", "updated_at"]
    list_select_related = ["organization"]
    search_fields = ["=organization__slug"]
    list_filter = ["action"]

    @admin.display(description="monthly limit")
    def limit(self, budget: Budget) -> str:
        return usd(budget.monthly_limit_cents)


@admin.register(BudgetEvent)
class BudgetEventAdmin(LedgerAdmin):
    list_display = ["at", "organization", "month", "threshold", "limit_cents", "spend_cents",
                    "projected_cents", "stopped"]
    list_select_related = ["organization"]
    search_fields = ["=organization__slug"]
    list_filter = ["stopped", "threshold"]
    readonly_fields = [field.name for field in BudgetEvent._meta.fields]



class BillingAccountForm(forms.ModelForm):
    clear_delinquency = forms.BooleanField(
        required=False, help_text="Lift the hold its failed payment put on the organisation "
                                  "(a budget's stays); its invoices keep their status.")
    reason = forms.CharField(required=False, max_length=500, widget=forms.Textarea(
        attrs={"rows": 2}), help_text="Why: kept in this account's history.")

    class Meta:
        model = BillingAccount
        fields: list[str] = []

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if cleaned.get("clear_delinquency"):
            if self.instance.delinquent_since is None:
                self.add_error("clear_delinquency", "This account is not delinquent.")
            if not cleaned.get("reason", "").strip():
                self.add_error("reason", "Say why: the reason is kept in the history.")
        return cleaned


@admin.register(BillingAccount)
class BillingAccountAdmin(admin.ModelAdmin):
    list_display = ["organization", "stripe_customer_id", "payment_method", "delinquent_since"]
    list_filter = [("delinquent_since", admin.EmptyFieldListFilter)]
    list_select_related = ["organization"]
    search_fields = ["=organization__slug", "=stripe_customer_id"]
    form = BillingAccountForm
    readonly_fields = ["organization", "stripe_customer_id", "stripe_subscription_id",
                       "payment_method", "delinquent_since", "delinquent_reason"]
    fields = [*readonly_fields, "clear_delinquency", "reason"]

    def save_model(self, request: HttpRequest, obj: BillingAccount, form: Any,
                   change: bool) -> None:
        if form.cleaned_data.get("clear_delinquency"):
            do_clear_delinquency(account=obj)

    def construct_change_message(self, request: HttpRequest, form: Any, formsets: Any,
                                 add: bool = False) -> str | list:
        if form.cleaned_data.get("clear_delinquency"):
            return f"Cleared the delinquency: {form.cleaned_data['reason'].strip()}"
        return super().construct_change_message(request, form, formsets, add)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(StripeEvent)
class StripeEventAdmin(LedgerAdmin):
    """Every webhook delivery as Stripe sent it, and what handling it did: read only."""

    list_display = ["received_at", "type", "stripe_id", "handled_at", "outcome"]
    list_filter = ["type"]
    search_fields = ["=stripe_id"]
    readonly_fields = ["stripe_id", "type", "payload", "received_at", "handled_at", "outcome"]

