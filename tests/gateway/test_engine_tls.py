"""The gateway reaches engines over TLS, checking each one's certificate against the control
plane's authority and its replica's name: an engine that presents another replica's
certificate (another engine on the node, taking this one's port) is sent nothing.

The gateway's ASGI app driven in this process, in front of stand-in engines
(tests.stub_upstream) serving TLS; the same against a real vLLM engine is in tests/e2e."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from accounts.models import Organization
from bench.seed import certify
from endpoints.models import Replica
from engine.processes import dying_with_parent, free_port
from fleet.certificates import engine_address
from kvrun.launcher import uvicorn_args, wait_until_listening
from tests.factories import ready_endpoint
from tests.gateway.helpers import InProcessGateway
from tests.helpers import ROOT, stop

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def serving_tls(port: int, key: Path, certificate: Path) -> subprocess.Popen:
    """A stand-in engine on `port`, serving TLS with `key` and `certificate`."""
    process = subprocess.Popen(
        [sys.executable, *uvicorn_args("tests.stub_upstream:app", port=port),
         "--ssl-keyfile", str(key), "--ssl-certfile", str(certificate)],
        cwd=ROOT, preexec_fn=dying_with_parent)
    wait_until_listening(process, port)
    return process


@pytest.fixture
def honest_and_impostor(org: Organization, tmp_path: Path
                        ) -> Iterator[tuple[Replica, Replica]]:
    """A ready replica of "chat" and one of "other", each signed a certificate: the first's
    engine presents its own, the second's engine presents the first's."""
    honest = ready_endpoint(org, "chat", [free_port()]).replicas.get()
    impostor = ready_endpoint(org, "other", [free_port()]).replicas.get()
    honest_files = certify(honest, tmp_path / "honest")
    certify(impostor, tmp_path / "impostor")
    engines = [serving_tls(honest.port, *honest_files),
               serving_tls(impostor.port, *honest_files)]
    yield Replica.objects.get(id=honest.id), Replica.objects.get(id=impostor.id)
    for engine in engines:
        stop(engine)


def test_an_engine_is_reached_by_its_replica_s_name_and_an_impostor_is_sent_nothing(
        gateway: InProcessGateway, secret: str,
        honest_and_impostor: tuple[Replica, Replica], caplog: pytest.LogCaptureFixture) -> None:
    honest, impostor = honest_and_impostor

    answered = gateway.post(secret, {"model": "chat", "prompt": "hello", "max_tokens": 4})
    refused = gateway.post(secret, {"model": "other", "prompt": "hello", "max_tokens": 4})

    assert answered.status_code == 200, answered.text
    with engine_address(replica=honest).client(timeout=30) as engine:
        assert len(engine.get("/_requests").json()) == 1
    # The impostor's port answers TLS with the other replica's certificate, which does not
    # name its own replica: the gateway sends it nothing, as to an engine that is down.
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert f"https://127.0.0.1:{impostor.port} refused" in caplog.text
    with httpx.Client(base_url=f"https://127.0.0.1:{impostor.port}", verify=False) as raw:
        assert raw.get("/_requests").json() == []
