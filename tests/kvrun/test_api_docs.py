import pytest
import yaml
from django.test import Client
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from accounts.models import Organization


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


def test_every_operation_documents_the_errors_it_can_answer_with(api: APIClient) -> None:
    schema = yaml.safe_load(api.get("/api/schema/").content)

    assert set(schema["components"]["schemas"]["Error"]["properties"]) == {"error"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            documented = set(operation["responses"])
            assert {"401", "403", "429"} <= documented, (method, path)
            if "{" in path:
                assert "404" in documented, (method, path)
            if "requestBody" in operation:
                assert {"400", "413", "415"} <= documented, (method, path)
                # JSON everywhere but the one route that takes files.
                assert set(operation["requestBody"]["content"]) == (
                    {"multipart/form-data"} if path.endswith("/adapters/upload/")
                    else {"application/json"}), (method, path)


@pytest.mark.parametrize("debug", [False, True])
def test_an_unknown_api_path_answers_in_the_api_s_error_envelope(
        api: APIClient, settings: object, debug: bool) -> None:
    # Under DEBUG (`make run`) Django answers its own HTML page, not the handler404.
    settings.DEBUG = debug
    for path in ("/api/v1/no-such-thing/", "/api/v1/organizations/acme/endpoints/a/b/c/"):
        response = api.get(path)

        assert response.status_code == 404
        assert response["Content-Type"] == "application/json"
        assert response.json()["error"]["type"] == "not_found"
    # A path that lacks only its trailing slash is still sent to the one that has it.
    assert api.get("/api/v1/models").status_code == 301


@pytest.mark.django_db
def test_a_route_s_own_404_keeps_its_message_in_the_browsable_api_too(
        owner_api: APIClient) -> None:
    missing = owner_api.get("/api/v1/models/no-such-model/", HTTP_ACCEPT="text/html")

    assert missing.status_code == 404
    assert b"No such API path" not in missing.content


@pytest.mark.django_db
def test_a_page_size_out_of_range_is_refused_rather_than_ignored(owner_api: APIClient) -> None:
    for asked in ("0", "201", "null"):
        response = owner_api.get(f"/api/v1/models/?page_size={asked}")

        assert response.status_code == 400, asked
        assert response.json()["error"]["fields"] == {
            "page_size": ["A whole number from 1 to 200."]}
    assert owner_api.get("/api/v1/models/?page_size=200").status_code == 200


@pytest.mark.django_db
def test_the_api_takes_json_only(owner_api: APIClient, org: Organization) -> None:
    response = owner_api.post(f"/api/v1/organizations/{org.slug}/api-keys/",
                              {"name": "ci", "scope": "inference"}, format="multipart")

    assert response.status_code == 415
    assert not org.api_keys.exists()


@pytest.mark.django_db
def test_an_invalid_item_of_a_list_field_is_named_in_the_message(owner_api: APIClient,
                                                                 org: Organization) -> None:
    response = owner_api.post(f"/api/v1/organizations/{org.slug}/api-keys/",
                              {"name": "ci", "scope": "inference",
                               "endpoint_names": ["chat", "", "x y"]}, format="json")

    assert response.status_code == 400  # was a 500
    message = response.json()["error"]["message"]
    assert "endpoint_names: item 2: This field may not be blank." in message
    assert "item 3: " in message
    assert not org.api_keys.exists()
