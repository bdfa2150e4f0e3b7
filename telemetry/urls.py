from django.urls import path

from telemetry import api

urlpatterns = [
    path("organizations/<slug:org_slug>/endpoints/<slug:name>/metrics/",
         api.EndpointMetrics.as_view(), name="api-endpoint-metrics"),
]
