from django.urls import path

from telemetry import api

urlpatterns = [
    path("organizations/<slug:org_slug>/endpoints/<slug:name>/metrics/",
         api.EndpointMetrics.as_view(), name="api-endpoint-metrics"),
    path("organizations/<slug:org_slug>/endpoints/<slug:name>/advice/",
         api.EndpointAdvice.as_view(), name="api-endpoint-advice"),
    path("organizations/<slug:org_slug>/endpoints/<slug:name>/advice/<int:advice_id>/apply/",
         api.ApplyAdvice.as_view(), name="api-endpoint-advice-apply"),
]
