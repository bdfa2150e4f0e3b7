"""The billing REST API: an organisation's invoices (drafts and finalised), their lines and
the ledger rows behind each line, for owners and admins; daily usage and what each endpoint
costs, for every member (as the dashboard shows them)."""

from datetime import date

from django.http import Http404
from django.utils import timezone
from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.scoping import OrganizationScoped
from accounts.services import require_manager
from billing import selectors
from billing.invoicing import month_label
from billing.models import LineKind
from billing.serializers import (
    DailyUsageSerializer,
    EndpointCostSerializer,
    IntervalSerializer,
    InvoiceDetailSerializer,
    InvoiceSerializer,
    RecordSerializer,
    UsageQuery,
)
from endpoints.selectors import endpoints_of


class BillingView(OrganizationScoped, GenericAPIView):
    filter_backends = ()  # lists kvrun builds itself, in their own order
    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        if not getattr(self, "swagger_fake_view", False):
            require_manager(self.actor_role, "see the organisation's invoices")

    def invoice(self, month: date) -> selectors.InvoiceView:
        invoice = selectors.invoice_of(organization=self.organization, month=month)
        if invoice is None:
            raise Http404("That month has not begun.")
        return invoice

    def context(self) -> dict:
        return {"org_slug": self.organization.slug}


class InvoiceList(BillingView):
    """The open month's draft, an ended month's draft until it is finalised, then every
    finalised invoice, newest first."""

    serializer_class = InvoiceSerializer

    @extend_schema(responses=InvoiceSerializer(many=True))
    def get(self, request: Request, **kwargs: str) -> Response:
        page = self.paginate_queryset(selectors.invoices_of(organization=self.organization))
        return self.get_paginated_response(
            InvoiceSerializer(page, many=True, context=self.context()).data)


class InvoiceDetail(BillingView):
    """One month's invoice with its lines; a month not finalised yet is its draft."""

    serializer_class = InvoiceDetailSerializer

    def get(self, request: Request, month: date, **kwargs: str) -> Response:
        return Response(InvoiceDetailSerializer(self.invoice(month), context=self.context()).data)


class LineUsage(BillingView):
    """The ledger rows behind one line (by its number on the invoice): replica intervals for
    GPU time, usage records for tokens."""

    @extend_schema(responses=PolymorphicProxySerializer(
        component_name="LineUsage", serializers=[IntervalSerializer, RecordSerializer],
        resource_type_field_name=None, many=True))
    def get(self, request: Request, month: date, number: int, **kwargs: str) -> Response:
        shown = self.invoice(month)
        line = shown.line(number)
        if line is None:
            raise Http404(f"The invoice for {month_label(month)} has {len(shown.lines)} "
                          f"line(s).")
        serializer = IntervalSerializer if line.kind == LineKind.GPU_TIME else RecordSerializer
        page = self.paginate_queryset(selectors.usage_behind(
            organization=self.organization, line=line, billed_at=shown.finalized_at))
        return self.get_paginated_response(serializer(page, many=True).data)


class EndpointCost(OrganizationScoped, GenericAPIView):
    """What an endpoint really costs: its price per hour, its cost this month so far, and the
    GPU cost per million tokens it served over the last hour and day (the figure to set
    against a shared API's token price). Tokens billed on top, if any, are not in it."""

    serializer_class = EndpointCostSerializer

    def get(self, request: Request, name: str, **kwargs: str) -> Response:
        endpoint = endpoints_of(organization=self.organization).filter(name=name).first()
        if endpoint is None:
            raise Http404(f"No endpoint named {name!r} in this organisation.")
        now = timezone.now()
        costs = {hours: selectors.window_costs(endpoint_ids=[endpoint.id], hours=hours,
                                               now=now)[endpoint.id] for hours in (1, 24)}
        month = selectors.month_to_date_by_endpoint(organization=self.organization, now=now)
        return Response(EndpointCostSerializer({
            "endpoint": endpoint.name, "hourly_price_usd": endpoint.hourly_price_usd,
            "month_to_date_cents": month.get(endpoint.id, 0), "last_hour": costs[1],
            "last_day": costs[24]}).data)


class DailyUsage(OrganizationScoped, GenericAPIView):
    """GPU-hours (billed phases) and tokens per UTC day over the last `days` days (30 by
    default, at most 366), oldest first, days without usage included; for every member."""

    serializer_class = DailyUsageSerializer
    pagination_class = None  # a series, not pages
    filter_backends = ()

    @extend_schema(parameters=[UsageQuery], responses=DailyUsageSerializer(many=True))
    def get(self, request: Request, **kwargs: str) -> Response:
        query = UsageQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        days = selectors.daily_usage(organization=self.organization,
                                     days=query.validated_data["days"])
        return Response(DailyUsageSerializer(days, many=True).data)
