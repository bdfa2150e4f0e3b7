from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from billing.views import stripe_webhook
from kvrun.common import health
from telemetry import views as telemetry_views

handler404 = "kvrun.common.api.not_found"

admin.site.site_header = admin.site.site_title = "kvrun console"
admin.site.index_title = "Nodes, endpoints, usage and accounts"

urlpatterns = [
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", telemetry_views.metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("billing/stripe/webhook", stripe_webhook, name="stripe-webhook"),
    path("api/v1/", include("accounts.urls")),
    path("api/v1/", include("endpoints.urls")),
    path("api/v1/", include("billing.urls")),
    path("api/v1/", include("telemetry.urls")),
    path("node/v1/", include("fleet.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("", include("accounts.page_urls")),
    path("", include("front.urls")),
]
