import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import orjson
import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import APIKey, Organization, Scope, User
from accounts.selectors import get_key_identity, key_cache_name
from kvrun.common.digests import secret_digest
from kvrun.common.redis import redis_client
from tests.factories import api_key
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db


def keys_url(org: Organization) -> str:
    return f"/api/v1/organizations/{org.slug}/api-keys/"


def bearer(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_it_creates_a_key_and_shows_the_secret_once(owner_api: APIClient,
                                                    org: Organization) -> None:
    response = owner_api.post(keys_url(org), {"name": "ci", "scope": "inference"}, format="json")

    assert response.status_code == 201, response.content
    assert "no-store" in response["Cache-Control"]  # no cache may keep the secret
    body = response.json()
    secret = body["secret"]
    # kvr_ and 43 base62 characters: 256 bits, as the API documentation says.
    assert re.fullmatch(r"kvr_[A-Za-z0-9]{43}", secret), secret
    key = APIKey.objects.get(id=body["id"])
    assert key.scope == Scope.INFERENCE
    assert key.prefix == secret[:8] and key.last_four == secret[-4:]
    assert key.created_by.email == "owner@acme.test"

    again = owner_api.get(f"{keys_url(org)}{key.id}/").json()
    assert "secret" not in again
    assert again["prefix"] == key.prefix


def test_the_secret_never_reaches_the_database(owner_api: APIClient, org: Organization) -> None:
    secret = owner_api.post(keys_url(org), {"name": "scan"}, format="json").json()["secret"]

    with connection.cursor() as cursor:
        cursor.execute("SELECT row_to_json(k)::text FROM accounts_apikey k")
        rows = [row[0] for row in cursor.fetchall()]
        cursor.execute("SELECT coalesce(string_agg(session_data, ''), '') FROM django_session")
        sessions = cursor.fetchone()[0]
    assert rows
    assert not any(secret in row or secret[4:] in row for row in rows)
    assert secret not in sessions


def test_a_manage_key_calls_the_api(org: Organization, manage_secret: str) -> None:
    response = bearer(manage_secret).get(keys_url(org))

    assert response.status_code == 200
    assert response.json()["count"] == 1


def test_an_inference_key_is_refused_for_management(org: Organization) -> None:
    _, secret = api_key(org, scope=Scope.INFERENCE)

    response = bearer(secret).get(keys_url(org))

    assert response.status_code == 403
    assert "manage scope" in response.json()["error"]["message"]


def test_a_revoked_key_is_refused_at_once(owner_api: APIClient, org: Organization) -> None:
    key, secret = api_key(org)
    client = bearer(secret)
    assert client.get(keys_url(org)).status_code == 200  # now cached

    assert owner_api.delete(f"{keys_url(org)}{key.id}/").status_code == 204

    response = client.get(keys_url(org))
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_a_revocation_made_elsewhere_holds_within_the_cache_ttl(
    org: Organization, settings: object
) -> None:
    settings.KVRUN_API_KEY_CACHE_SECONDS = 2
    key, secret = api_key(org)
    client = bearer(secret)
    assert client.get(keys_url(org)).status_code == 200
    # A write that bypasses the service (another process, a SQL console) leaves the cache stale.
    APIKey.objects.filter(id=key.id).update(revoked_at=timezone.now())

    assert wait_until(lambda: client.get(keys_url(org)).status_code == 401, timeout=4)


def test_an_expired_key_is_refused(org: Organization) -> None:
    key, secret = api_key(org, expires_at=timezone.now() + timedelta(seconds=60))
    APIKey.objects.filter(id=key.id).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert bearer(secret).get(keys_url(org)).status_code == 401


def test_it_refuses_an_expiry_in_the_past(owner_api: APIClient, org: Organization) -> None:
    past = (timezone.now() - timedelta(days=1)).isoformat()

    response = owner_api.post(keys_url(org), {"name": "old", "expires_at": past}, format="json")

    assert response.status_code == 400
    assert "future" in response.json()["error"]["fields"]["expires_at"][0]
    assert not APIKey.objects.exists()


@pytest.mark.parametrize("header", ["Bearer kvr_nothere", "Bearer nonsense", "Bearer "])
def test_an_unknown_key_is_refused(org: Organization, header: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)

    assert client.get(keys_url(org)).status_code == 401


def test_a_member_cannot_create_keys(api: APIClient, org: Organization) -> None:
    from accounts.models import Membership, Role
    from tests.factories import UserFactory

    member = UserFactory()
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    api.force_authenticate(member)

    response = api.post(keys_url(org), {"name": "mine"}, format="json")

    assert response.status_code == 403
    assert "owners and admins" in response.json()["error"]["message"]
    assert not APIKey.objects.exists()
    assert api.get(keys_url(org)).status_code == 200


def test_lists_filter_and_order(owner_api: APIClient, org: Organization) -> None:
    api_key(org, name="b", scope=Scope.INFERENCE)
    revoked, _ = api_key(org, name="a")
    APIKey.objects.filter(id=revoked.id).update(revoked_at=timezone.now())

    active = owner_api.get(keys_url(org), {"revoked": "false"}).json()
    ordered = owner_api.get(keys_url(org), {"ordering": "name"}).json()
    inference = owner_api.get(keys_url(org), {"scope": "inference"}).json()

    assert [k["name"] for k in active["results"]] == ["b"]
    assert [k["name"] for k in ordered["results"]] == ["a", "b"]
    assert [k["name"] for k in inference["results"]] == ["b"]


@pytest.mark.django_db(transaction=True)
def test_last_used_at_is_recorded_by_the_worker(celery_worker: object) -> None:
    from tests.factories import organization_with_owner

    org = organization_with_owner("Worker Org")
    key, secret = api_key(org)

    assert bearer(secret).get(keys_url(org)).status_code == 200

    assert wait_until(lambda: APIKey.objects.get(id=key.id).last_used_at is not None, timeout=20)
    used = APIKey.objects.get(id=key.id).last_used_at
    assert timezone.now() - used < timedelta(seconds=30)


def test_the_me_endpoint_answers_for_users_and_keys(owner_api: APIClient, owner: User,
                                                    org: Organization, manage_secret: str) -> None:
    assert owner_api.get("/api/v1/me/").json()["email"] == owner.email
    as_key = bearer(manage_secret).get("/api/v1/me/").json()
    assert as_key["organization"]["slug"] == org.slug
    assert as_key["api_key"]["scope"] == "manage"


def test_an_unknown_key_is_remembered_as_unknown_for_a_few_seconds(
    db: None, django_assert_num_queries: Callable[..., Any]
) -> None:
    made_up = f"kvr_{'x' * 40}"
    assert get_key_identity(secret=made_up) is None

    with django_assert_num_queries(0):
        assert get_key_identity(secret=made_up) is None


def test_the_key_cache_holds_json_that_no_one_can_smuggle_code_into(
    org: Organization, django_assert_num_queries: Callable[..., Any]
) -> None:
    key, secret = api_key(org)
    identity = get_key_identity(secret=secret)

    stored = redis_client().get(f"kvrun:2:{key_cache_name(secret_digest(secret))}")

    assert orjson.loads(stored)["id"] == str(key.id)  # JSON, where Django would pickle
    with django_assert_num_queries(0):
        assert get_key_identity(secret=secret) == identity


def test_a_key_names_endpoints_or_single_adapters(owner_api: APIClient,
                                                  org: Organization) -> None:
    created = owner_api.post(keys_url(org), {"name": "lawyers", "endpoint_names": [
        "chat", "chat:legal"]}, format="json")
    refused = owner_api.post(keys_url(org), {"name": "odd", "endpoint_names": [
        "chat:legal:v2"]}, format="json")

    assert created.status_code == 201, created.content
    assert APIKey.objects.get().endpoint_names == ["chat", "chat:legal"]
    assert refused.status_code == 400
    assert refused.json()["error"]["fields"]["endpoint_names"] == {
        "0": ["Name an endpoint, or one adapter of an endpoint as endpoint:adapter."]}
