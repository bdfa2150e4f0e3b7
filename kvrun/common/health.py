"""Probes for load balancers and orchestrators: liveness and readiness."""

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """The process is up and serving requests; checks nothing else."""
    return JsonResponse({"status": "ok"})


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """Ready when the database and the broker both answer; 503 names the one that does not."""
    checks = {"database": _check_database(), "broker": _check_broker()}
    ready = all(result == "ok" for result in checks.values())
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )


def _check_database() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return "ok"
    except Exception as exc:  # any failure means not ready; say which
        return f"error: {exc.__class__.__name__}"


def _check_broker() -> str:
    try:
        client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=2,
                                      socket_connect_timeout=2)
        client.ping()
        return "ok"
    except Exception as exc:  # any failure means not ready; say which
        return f"error: {exc.__class__.__name__}"
