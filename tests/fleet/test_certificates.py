"""Engines' TLS certificates: signed for a replica's own name from a key that stays on its
node, and trusted through the control plane's authority alone."""

import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from endpoints.models import Node, Replica, State
from engine import tls
from fleet.certificates import engine_address
from fleet.models import CertificateAuthority
from kvrun.common.digests import engine_api_key
from tests.fleet.helpers import as_node, enrolled, placed_replica

pytestmark = pytest.mark.django_db


def signing_request(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey,
                    asked_name: str = "anything.example") -> str:
    return (x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, asked_name)]))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(asked_name)]),
                           critical=False)
            .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())


@pytest.fixture
def replica(credential: str) -> Replica:
    replica = placed_replica(Node.objects.get(name="gpu-1"))
    Replica.objects.filter(id=replica.id).update(state=State.LOADING)
    return replica


def served_once(tmp_path: Path, key: ec.EllipticCurvePrivateKey, certificate: str) -> int:
    """A TLS server on loopback presenting `certificate` for one connection; its port."""
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_text(certificate)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        connection, _ = listener.accept()
        try:
            with context.wrap_socket(connection, server_side=True) as tls:
                tls.sendall(b"hello")
        except ssl.SSLError:
            pass  # a client that refused the certificate
        finally:
            listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def handshake(port: int, authority: str, host_name: str) -> bytes:
    context = ssl.create_default_context(cadata=authority)
    with socket.create_connection(("127.0.0.1", port)) as raw, context.wrap_socket(
            raw, server_hostname=host_name) as tls:
        return tls.recv(5)


def test_an_engine_certificate_names_its_replica_and_verifies_through_the_authority(
        credential: str, replica: Replica, tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())

    response = as_node(credential).post(f"/node/v1/replicas/{replica.id}/certificate", {
        "signing_request": signing_request(key, asked_name="gateway.example")}, format="json")

    assert response.status_code == 201
    body = response.json()
    assert body["host_name"] == f"{replica.id}.node-{replica.node_id}.replicas.kvrun.internal"
    certificate = x509.load_pem_x509_certificate(body["certificate"].encode())
    # The name is the control plane's choice, not the request's.
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.DNSName) == [body["host_name"]]
    assert certificate.public_key() == key.public_key()
    # The authority's key is kept sealed: the table alone holds no private key.
    assert "PRIVATE KEY" not in CertificateAuthority.objects.get().key_sealed

    port = served_once(tmp_path, key, body["certificate"])
    assert handshake(port, body["authority"], body["host_name"]) == b"hello"
    # Gateways reach it by that name now; its next start needs a certificate again.
    replica.refresh_from_db()
    assert replica.tls
    Replica.objects.filter(id=replica.id).update(state=State.STARTING)
    moved = as_node(credential).post(f"/node/v1/replicas/{replica.id}/move", {
        "from_states": ["starting"], "to_state": "loading", "message": "", "port": 8123,
        "policy_version": 1}, format="json")
    assert moved.json() == {"moved": True}
    replica.refresh_from_db()
    assert not replica.tls


def test_the_address_gateways_use_checks_the_replica_s_name(credential: str,
                                                            replica: Replica) -> None:
    Replica.objects.filter(id=replica.id).update(port=8123)
    replica.refresh_from_db()
    plain = engine_address(replica=replica)
    assert (plain.base_url, plain.host_name, plain.ssl_context()) == (
        "http://10.0.0.7:8123", "", None)

    key_pem, request_pem = tls.new_key_and_request()  # as the agent makes them
    body = as_node(credential).post(f"/node/v1/replicas/{replica.id}/certificate", {
        "signing_request": request_pem}, format="json").json()
    replica.refresh_from_db()

    address = engine_address(replica=replica)
    assert address.base_url == "https://10.0.0.7:8123"
    assert address.host_name == body["host_name"]
    assert address.authority_pem == body["authority"]
    assert address.api_key == engine_api_key(replica_id=replica.id, node_id=replica.node_id)
    assert address.ssl_context().verify_mode == ssl.CERT_REQUIRED


def test_a_certificate_for_one_replica_does_not_pass_for_another(
        credential: str, replica: Replica, tmp_path: Path) -> None:
    other = placed_replica(Node.objects.get(name="gpu-1"))
    key = ec.generate_private_key(ec.SECP256R1())
    body = as_node(credential).post(f"/node/v1/replicas/{replica.id}/certificate", {
        "signing_request": signing_request(key)}, format="json").json()

    port = served_once(tmp_path, key, body["certificate"])
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(port, body["authority"],
                  f"{other.id}.node-{other.node_id}.replicas.kvrun.internal")


def test_a_certificate_the_authority_did_not_sign_is_refused(
        credential: str, replica: Replica, tmp_path: Path) -> None:
    authority = as_node(credential).post(f"/node/v1/replicas/{replica.id}/certificate", {
        "signing_request": signing_request(ec.generate_private_key(ec.SECP256R1()))},
        format="json").json()["authority"]
    key = ec.generate_private_key(ec.SECP256R1())
    name = f"{replica.id}.node-{replica.node_id}.replicas.kvrun.internal"
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrun engine")])
    forged = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
              .public_key(key.public_key()).serial_number(1)
              .not_valid_before(x509.load_pem_x509_certificate(
                  authority.encode()).not_valid_before_utc)
              .not_valid_after(x509.load_pem_x509_certificate(
                  authority.encode()).not_valid_after_utc)
              .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
              .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())

    port = served_once(tmp_path, key, forged)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(port, authority, name)


@pytest.mark.parametrize("request_pem, says", [
    ("not a request", "Not a PEM certificate signing request"),
    (lambda: signing_request(rsa.generate_private_key(public_exponent=65537, key_size=1024)),
     "The key must be EC on P-256, P-384 or P-521, or RSA of 2048 bits or more."),
    (lambda: signing_request(ec.generate_private_key(ec.SECP256K1())),
     "The key must be EC on P-256, P-384 or P-521, or RSA of 2048 bits or more."),
])
def test_a_bad_signing_request_is_refused(credential: str, replica: Replica,
                                          request_pem: object, says: str) -> None:
    pem = request_pem() if callable(request_pem) else request_pem
    response = as_node(credential).post(f"/node/v1/replicas/{replica.id}/certificate",
                                        {"signing_request": pem}, format="json")

    assert response.status_code == 400
    assert response.json()["error"]["fields"]["signing_request"][0].startswith(says)


def test_only_an_engine_being_started_gets_a_certificate(credential: str,
                                                         replica: Replica) -> None:
    Replica.objects.filter(id=replica.id).update(state=State.READY)
    response = as_node(credential).post(f"/node/v1/replicas/{replica.id}/certificate", {
        "signing_request": signing_request(ec.generate_private_key(ec.SECP256R1()))},
        format="json")

    assert response.status_code == 403
    thief = as_node(enrolled("gpu-2")).post(f"/node/v1/replicas/{replica.id}/certificate", {
        "signing_request": signing_request(ec.generate_private_key(ec.SECP256R1()))},
        format="json")
    assert thief.status_code == 404
