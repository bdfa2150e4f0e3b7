"""The REST API against its own OpenAPI schema (/api/schema/), fuzzed by schemathesis with
every check it has: no 5xx, only documented status codes, responses that match their schema,
schema-valid requests accepted and invalid ones refused. A client generated from the schema
then works."""

from collections.abc import Iterator

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import positive_data_acceptance

from accounts.models import Organization

pytestmark = pytest.mark.django_db


# Operations whose schema-valid requests may still be refused (400) for what they mean, which
# no schema can say: a key expiring in the past, a model or GPU type not in the catalog, a
# size that fits no hardware, a repository not on the hub. Every other check still runs on
# them.
REFUSED_FOR_WHAT_THEY_MEAN = {
    "POST /api/v1/organizations/{org_slug}/api-keys/",
    "POST /api/v1/organizations/{org_slug}/endpoints/",
    "POST /api/v1/organizations/{org_slug}/models/",
    "POST /api/v1/organizations/{org_slug}/sizing/",
    "POST /api/v1/sizing/",
}

schema = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())


@pytest.fixture(autouse=True)
def _requests_keep_the_test_s_connection() -> Iterator[None]:
    # As Django's test client does: the test's connection holds its transaction, so requests
    # must not close it.
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    yield
    for signal in (request_started, request_finished):
        signal.connect(close_old_connections)


@schema.parametrize()
# The same examples on every run, so that CI fails only on a change; run it with another
# seed (remove derandomize) to look for new findings.
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_the_api_keeps_to_its_schema(case: schemathesis.Case, org: Organization,
                                     manage_secret: str, hub_url: str) -> None:
    # Into the organisation the key belongs to, so that operations get past the 404, unless
    # the case is about a wrong path.
    organization = "org_slug" if "{org_slug}" in case.path else "slug"
    if (case.path.startswith("/api/v1/organizations/{") and case.path_parameters
            and (case.meta is None or not case.meta.is_negative_at(ParameterLocation.PATH))):
        case.path_parameters[organization] = org.slug
    semantic = case.operation.label in REFUSED_FOR_WHAT_THEY_MEAN
    case.call_and_validate(headers={"Authorization": f"Bearer {manage_secret}"},
                           excluded_checks=[positive_data_acceptance] if semantic else [])
