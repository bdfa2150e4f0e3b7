import pytest
from django.test import Client


@pytest.mark.django_db
def test_healthz_and_readyz_answer_when_everything_is_up(client: Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok"}


@pytest.mark.django_db
def test_readyz_names_the_broker_when_it_is_down(client: Client, settings: object) -> None:
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"

    response = client.get("/readyz")

    assert response.status_code == 503
    assert response.json()["checks"]["broker"].startswith("error")
    assert response.json()["checks"]["database"] == "ok"
