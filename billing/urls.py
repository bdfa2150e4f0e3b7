from datetime import date

from django.urls import path, register_converter

from billing import api
from billing.invoicing import month_label
from billing.rollup import FIRST_PRICE_FROM


class MonthConverter:
    """A calendar month in a URL, as 2026-01."""

    regex = r"\d{4}-(0[1-9]|1[0-2])"

    def to_python(self, value: str) -> date:
        year = int(value[:4])
        if year < FIRST_PRICE_FROM.year:  # before anything was billed: not a month of ours
            raise ValueError(value)
        return date(year, int(value[5:7]), 1)

    def to_url(self, value: date | str) -> str:
        return value if isinstance(value, str) else month_label(value)


register_converter(MonthConverter, "month")

INVOICES = "organizations/<slug:org_slug>/invoices/"

urlpatterns = [
    path(INVOICES, api.InvoiceList.as_view(), name="api-invoices"),
    path(f"{INVOICES}<month:month>/", api.InvoiceDetail.as_view(), name="api-invoice"),
    path(f"{INVOICES}<month:month>/lines/<int:number>/usage/", api.LineUsage.as_view(),
         name="api-invoice-line-usage"),
    path("organizations/<slug:org_slug>/endpoints/<slug:name>/cost/", api.EndpointCost.as_view(),
         name="api-endpoint-cost"),
    path("organizations/<slug:org_slug>/usage/", api.DailyUsage.as_view(), name="api-usage"),
]
