import pytest
import yaml
from django.test import Client
from openapi_spec_validator import validate


@pytest.mark.django_db
def test_the_openapi_schema_validates(client: Client) -> None:
    response = client.get("/api/schema/")

    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    validate(schema)
    paths = schema["paths"]
    for path in ["/api/v1/organizations/{org_slug}/api-keys/", "/api/v1/signup/",
                 "/api/v1/models/", "/api/v1/gpu-types/", "/api/v1/me/", "/api/v1/sizing/",
                 "/api/v1/organizations/{org_slug}/endpoints/",
                 "/api/v1/organizations/{org_slug}/endpoints/{name}/events/"]:
        assert path in paths
    assert "endpoints" in schema["info"]["description"]


@pytest.mark.django_db
def test_swagger_ui_uses_only_local_assets(client: Client) -> None:
    page = client.get("/api/docs/")

    assert page.status_code == 200
    html = page.content.decode()
    assert "swagger-ui" in html
    assert "cdn" not in html.lower() and "https://" not in html
    asset = client.get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert asset.status_code == 200


@pytest.mark.django_db
def test_an_anonymous_call_is_told_to_authenticate(client: Client) -> None:
    response = client.get("/api/v1/organizations/")

    assert response.status_code in (401, 403)
    assert response.json()["error"]["type"] == "not_authenticated"
