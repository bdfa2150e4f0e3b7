"""TLS for the gateway's traffic to engines: the control plane's certificate authority, and
the certificate it signs for each replica's engine.

A replica's certificate names the replica on its node, not the host (replica_host_name): a
client that asks for that name when it connects (as gateways and agents do, engine.tls)
reaches that replica's engine only, and no other engine on the node, whatever port it
takes, can stand in for it. The engine's key is made on its node and never leaves it: the
node sends a signing request, and only the name and usages the control plane sets go into
the certificate.
"""

import functools
from datetime import timedelta
from uuid import UUID

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.utils import timezone

from endpoints.models import Replica
from engine.tls import EngineAddress
from fleet.models import CertificateAuthority
from fleet.selectors import STARTING_ENGINE, NotNow
from kvrun.common.digests import engine_api_key
from kvrun.common.sealing import seal, unseal

AUTHORITY_LIFETIME = timedelta(days=3650)
ENGINE_CERTIFICATE_LIFETIME = timedelta(days=365)
ACCEPTED_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)
REPLICA_DOMAIN = "replicas.kvrun.internal"


class SigningRefused(ValueError):
    """A signing request that is not a valid request for an acceptable key."""


def replica_host_name(*, replica_id: UUID | str, node_id: int) -> str:
    """The name a replica's engine certificate carries, on node `node_id`: a replica that
    restarts on another node after a failure keeps its id, and the node it left must hold
    no certificate for its new place."""
    return f"{replica_id}.node-{node_id}.{REPLICA_DOMAIN}"


def engine_address(*, replica: Replica, authority_pem: str | None = None) -> EngineAddress:
    """How the control plane reaches the replica's engine (its node loaded with it): over
    TLS by the replica's name where it was signed a certificate, which every engine started
    by an agent is; `authority_pem`, where the caller read it already."""
    assert replica.node is not None and replica.port is not None  # its engine listens
    checked = {"host_name": replica_host_name(replica_id=replica.id, node_id=replica.node.id),
               "authority_pem": authority_pem or authority_certificate_pem()
               } if replica.tls else {}
    return EngineAddress(host=replica.node.address, port=replica.port,
                         api_key=engine_api_key(replica_id=replica.id, node_id=replica.node.id),
                         **checked)


def _get_or_create_authority() -> CertificateAuthority:
    """The authority, made on first use; two processes making it at once keep one."""
    found = CertificateAuthority.objects.filter(id=CertificateAuthority.ONLY).first()
    if found is not None:
        return found
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrun engine authority")])
    now = timezone.now()
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + AUTHORITY_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    CertificateAuthority.objects.bulk_create([CertificateAuthority(
        id=CertificateAuthority.ONLY, key_sealed=seal(key_pem),
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM).decode())],
        ignore_conflicts=True)
    return CertificateAuthority.objects.get(id=CertificateAuthority.ONLY)


def authority_certificate_pem() -> str:
    """The certificate engines are trusted by (the authority is made on first use)."""
    return _get_or_create_authority().certificate_pem


@functools.lru_cache(maxsize=4)
def _signing_key(key_sealed: str) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(unseal(key_sealed).encode(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def do_sign_engine_certificate(*, replica: Replica, request_pem: str) -> str:
    """A server certificate for the replica's engine, for the key in `request_pem` (a PEM
    signing request, signed by that key: EC on P-256, P-384 or P-521, or RSA of 2048 bits or
    more), while its engine is being started. Raises NotNow, and SigningRefused."""
    if replica.state not in STARTING_ENGINE:
        raise NotNow("The replica's engine is not being started.")
    try:
        request = x509.load_pem_x509_csr(request_pem.encode())
        public_key = request.public_key()
        signed_by_its_key = request.is_signature_valid
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise SigningRefused("Not a PEM certificate signing request for an EC or RSA key."
                             ) from exc
    if not signed_by_its_key:
        raise SigningRefused("The signing request's signature does not match its key.")
    if not (isinstance(public_key, ec.EllipticCurvePublicKey)
            and isinstance(public_key.curve, ACCEPTED_CURVES)
            or isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size >= 2048):
        raise SigningRefused(
            "The key must be EC on P-256, P-384 or P-521, or RSA of 2048 bits or more.")
    assert replica.node_id is not None  # being started: placed on a node
    if not Replica.objects.filter(id=replica.id, node_id=replica.node_id,
                                  state__in=STARTING_ENGINE).update(tls=True):
        raise NotNow("The replica's engine is not being started.")
    authority = _get_or_create_authority()
    issuer = x509.load_pem_x509_certificate(authority.certificate_pem.encode())
    now = timezone.now()
    name = replica_host_name(replica_id=replica.id, node_id=replica.node_id)
    certificate = (
        x509.CertificateBuilder()
        # The name is in the alternative names, where clients look; a common name holds
        # 64 characters at most, fewer than it has.
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrun engine")]))
        .issuer_name(issuer.subject).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + ENGINE_CERTIFICATE_LIFETIME)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            _signing_key(authority.key_sealed).public_key()), critical=False)
        .sign(_signing_key(authority.key_sealed), hashes.SHA256()))
    return certificate.public_bytes(serialization.Encoding.PEM).decode()
