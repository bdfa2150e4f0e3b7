from datetime import timedelta
from decimal import Decimal

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from billing.invoicing import Line, month_label
from billing.models import LineKind
from billing.selectors import InvoiceView
from endpoints.models import BilledPhase, ReplicaInterval


class LineSerializer(serializers.Serializer):
    number = serializers.SerializerMethodField()
    kind = serializers.ChoiceField(choices=LineKind.choices)
    description = serializers.CharField()
    endpoint = serializers.CharField(source="endpoint_name")
    phase = serializers.ChoiceField(choices=[("", ""), *BilledPhase.choices])
    usage_month = serializers.SerializerMethodField()
    adjustment = serializers.BooleanField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    quantity = serializers.DecimalField(max_digits=20, decimal_places=6)
    unit = serializers.CharField()
    unit_price_usd = serializers.DecimalField(max_digits=10, decimal_places=4)
    amount_cents = serializers.IntegerField()
    usage_url = serializers.SerializerMethodField()

    def get_number(self, line: Line) -> int:
        return self.context["numbers"][id(line)]

    def get_usage_month(self, line: Line) -> str:
        return month_label(line.usage_month)

    def get_usage_url(self, line: Line) -> str:
        return reverse("api-invoice-line-usage", kwargs={
            "org_slug": self.context["org_slug"], "month": self.context["month"],
            "number": self.get_number(line)})


class InvoiceSerializer(serializers.Serializer):
    month = serializers.SerializerMethodField()
    status = serializers.ChoiceField(choices=[("draft", "draft"), ("final", "final")])
    number = serializers.CharField()
    currency = serializers.CharField()
    total_cents = serializers.IntegerField()
    finalized_at = serializers.DateTimeField(allow_null=True)
    url = serializers.SerializerMethodField()

    def get_month(self, invoice: InvoiceView) -> str:
        return month_label(invoice.month)

    def get_url(self, invoice: InvoiceView) -> str:
        return reverse("api-invoice", kwargs={"org_slug": self.context["org_slug"],
                                              "month": month_label(invoice.month)})


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = serializers.SerializerMethodField()

    @extend_schema_field(LineSerializer(many=True))
    def get_lines(self, invoice: InvoiceView) -> list:
        context = {**self.context, "month": month_label(invoice.month),
                   "numbers": {id(line): n for n, line in enumerate(invoice.lines, 1)}}
        return list(LineSerializer(invoice.lines, many=True, context=context).data)


class IntervalSerializer(serializers.ModelSerializer):
    replica = serializers.UUIDField(source="replica_id")
    seconds = serializers.SerializerMethodField()

    class Meta:
        model = ReplicaInterval
        fields = ["replica", "phase", "gpu_count", "started_at", "ended_at", "seconds"]

    @extend_schema_field({"type": "string", "format": "decimal", "nullable": True})
    def get_seconds(self, interval: ReplicaInterval) -> str | None:
        """The whole interval's length, to the microsecond; empty while it is open."""
        if interval.ended_at is None:
            return None
        held = interval.ended_at - interval.started_at
        return str(Decimal(held // timedelta(microseconds=1)) / 10**6)


class RecordSerializer(serializers.Serializer):
    request_id = serializers.CharField()
    started_at = serializers.DateTimeField()
    ingested_at = serializers.DateTimeField()
    status_code = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()


class WindowCostSerializer(serializers.Serializer):
    gpu_cost_usd = serializers.DecimalField(max_digits=20, decimal_places=6)
    tokens = serializers.IntegerField()
    usd_per_million_tokens = serializers.DecimalField(max_digits=20, decimal_places=4,
                                                      allow_null=True)


class EndpointCostSerializer(serializers.Serializer):
    endpoint = serializers.CharField()
    hourly_price_usd = serializers.DecimalField(max_digits=10, decimal_places=4)
    month_to_date_cents = serializers.IntegerField()
    last_hour = WindowCostSerializer()
    last_day = WindowCostSerializer()


class DailyUsageSerializer(serializers.Serializer):
    day = serializers.DateField()
    gpu_hours = serializers.DecimalField(max_digits=20, decimal_places=6)
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()


class UsageQuery(serializers.Serializer):
    days = serializers.IntegerField(min_value=1, max_value=366, default=30)
