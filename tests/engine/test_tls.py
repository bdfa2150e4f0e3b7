"""How kvrun reaches an engine (engine.tls): over TLS, by its replica's name, straight to it."""

import datetime
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine import tls
from engine.supervisor import EngineFailed, wait_ready
from engine.tls import EngineAddress

NAME = "r1.node-1.replicas.kvrun.internal"


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """An HTTPS server on loopback with a certificate for NAME (its own authority): its
    port, and that certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrun engine")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(key.public_key()).serial_number(1)
                   .not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]),
                                  critical=False)
                   .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("engine")
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
    key_file, certificate_file = tls.write_key_and_certificate(folder, key_pem=key_pem,
                                                               certificate_pem=pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificate_file, key_file)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], pem
    server.shutdown()


def test_an_engine_is_reached_by_its_replica_s_name_through_its_authority(
        engine: tuple[int, str]) -> None:
    port, authority = engine
    address = EngineAddress(host="127.0.0.1", port=port, api_key="engine-secret", host_name=NAME,
                            authority_pem=authority)

    with address.client(timeout=10) as client:
        assert client.get("/health").status_code == 200
    assert address.base_url == f"https://127.0.0.1:{port}"
    assert EngineAddress(host="::1", port=8000, api_key="k").base_url == "http://[::1]:8000"
    assert "engine-secret" not in repr(address)  # its key stays out of logs


def test_not_through_a_proxy_a_node_sets_for_its_downloads(
        engine: tuple[int, str], monkeypatch: pytest.MonkeyPatch) -> None:
    port, authority = engine
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens there
    address = EngineAddress(host="127.0.0.1", port=port, api_key="k", host_name=NAME,
                            authority_pem=authority)

    with address.client(timeout=10) as client:
        assert client.get("/health").status_code == 200


def test_an_engine_with_a_certificate_for_another_name_fails_its_start_at_once(
        engine: tuple[int, str]) -> None:
    port, authority = engine
    other = EngineAddress(host="127.0.0.1", port=port, api_key="k",
                          host_name="r2.node-1.replicas.kvrun.internal", authority_pem=authority)
    started = time.monotonic()

    with pytest.raises(EngineFailed, match="certificate was refused: Hostname mismatch"):
        wait_ready(address=other, served_model_name="chat", alive=lambda: True, timeout=60)

    assert time.monotonic() - started < 30  # not the whole start timeout


def test_the_agent_writes_the_engine_s_files_anew_never_through_a_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "agent-file"
    elsewhere.write_text("the agent's")
    folder = tmp_path / "replica"
    folder.mkdir()
    (folder / tls.CERTIFICATE_FILE).symlink_to(elsewhere)  # left by an engine
    key_pem, _ = tls.new_key_and_request()

    key, certificate = tls.write_key_and_certificate(folder, key_pem=key_pem,
                                                     certificate_pem="CERTIFICATE")

    assert elsewhere.read_text() == "the agent's"
    assert not certificate.is_symlink() and certificate.read_text() == "CERTIFICATE"
    assert key.stat().st_mode & 0o777 == 0o600
