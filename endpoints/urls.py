from django.urls import path
from rest_framework.parsers import MultiPartParser
from rest_framework.routers import SimpleRouter

from endpoints import api

router = SimpleRouter()
router.register("models", api.ModelCatalogViewSet, basename="model")
router.register("gpu-types", api.GPUCatalogViewSet, basename="gpu-type")
router.register("regions", api.RegionViewSet, basename="region")

ENDPOINT = "organizations/<slug:org_slug>/endpoints/<slug:name>"
endpoint = api.EndpointViewSet
ADAPTERS = "organizations/<slug:org_slug>/endpoints/<slug:endpoint_name>/adapters"
adapters = api.AdapterViewSet

urlpatterns = [
    path("sizing/", api.size, name="api-sizing"),
    path("organizations/<slug:org_slug>/sizing/", api.OrganizationSizing.as_view(),
         name="api-organization-sizing"),
    path("organizations/<slug:org_slug>/endpoints/",
         endpoint.as_view({"get": "list", "post": "create"}), name="api-endpoints"),
    path(f"{ENDPOINT}/", endpoint.as_view({"get": "retrieve", "delete": "destroy"}),
         name="api-endpoint"),
    path(f"{ENDPOINT}/policy/", endpoint.as_view({"patch": "policy"}),
         name="api-endpoint-policy"),
    path(f"{ENDPOINT}/scaling/", endpoint.as_view({"patch": "scaling"}),
         name="api-endpoint-scaling"),
    path(f"{ENDPOINT}/scale/", endpoint.as_view({"post": "scale"}), name="api-endpoint-scale"),
    path(f"{ENDPOINT}/stop/", endpoint.as_view({"post": "stop"}), name="api-endpoint-stop"),
    path(f"{ENDPOINT}/start/", endpoint.as_view({"post": "start"}), name="api-endpoint-start"),
    path(f"{ENDPOINT}/events/", endpoint.as_view({"get": "events"}), name="api-endpoint-events"),
    path(f"{ADAPTERS}/", adapters.as_view({"get": "list", "post": "create"}),
         name="api-endpoint-adapters"),
    path(f"{ADAPTERS}/upload/",
         adapters.as_view({"post": "upload"}, parser_classes=[MultiPartParser]),
         name="api-endpoint-adapters-upload"),
    path(f"{ADAPTERS}/<slug:name>/",
         adapters.as_view({"get": "retrieve", "delete": "destroy"}),
         name="api-endpoint-adapter"),
    path("organizations/<slug:org_slug>/nodes/", api.OrganizationNodes.as_view(),
         name="api-organization-nodes"),
    path("organizations/<slug:org_slug>/models/",
         api.OrganizationModelViewSet.as_view({"get": "list", "post": "create"}),
         name="api-organization-models"),
    path("organizations/<slug:org_slug>/models/<str:slug>/",
         api.OrganizationModelViewSet.as_view({"get": "retrieve"}),
         name="api-organization-model"),
    *router.urls,
]
