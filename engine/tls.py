"""How kvrun reaches an engine: over TLS, checked by the name of the replica it serves. Pure
Python, no Django.

An engine serves HTTPS with a key made on its node, which never leaves it, and a certificate
the control plane signs for its replica (fleet.certificates). Whoever calls it (the gateway,
the node agent) trusts the control plane's authority alone and checks the replica's name, not
the address it dials: no other engine on the node, whatever port it takes, can stand in for
it, and prompts, answers and engine keys do not cross a network in the clear.
"""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# In the replica's own directory: bound into its engine's sandbox, deleted when it stops.
KEY_FILE, CERTIFICATE_FILE = "engine-tls.key", "engine-tls.crt"


@dataclass(frozen=True)
class EngineAddress:
    """Where an engine listens, the key it takes and, for one that serves HTTPS, the name
    its certificate carries and the authority that signed it (both "" for an engine that
    serves plain HTTP: a bare engine a benchmark starts to compare)."""

    host: str
    port: int
    api_key: str = field(repr=False)
    host_name: str = ""
    authority_pem: str = field(default="", repr=False)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.host_name else 'http'}://{host}:{self.port}"

    @property
    def authorization(self) -> str:
        return f"Bearer {self.api_key}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """What checks the engine's certificate: the authority, and the name; None for plain
        HTTP."""
        return trusting(self.authority_pem) if self.host_name else None

    def client(self, *, timeout: float) -> httpx.Client:
        """A client of this engine: its base URL, its key, its certificate checked."""
        def name_it(request: httpx.Request) -> None:
            request.extensions["sni_hostname"] = self.host_name

        return httpx.Client(**self._options(timeout),
                            event_hooks={"request": [name_it] if self.host_name else []})

    def async_client(self, *, timeout: float) -> httpx.AsyncClient:
        """As `client`, for asyncio."""
        async def name_it(request: httpx.Request) -> None:
            request.extensions["sni_hostname"] = self.host_name

        return httpx.AsyncClient(**self._options(timeout),
                                 event_hooks={"request": [name_it] if self.host_name else []})

    def _options(self, timeout: float) -> dict[str, Any]:
        # Straight to the engine: a proxy a node sets for its downloads would check the
        # certificate against the address, not the replica's name.
        return {"base_url": self.base_url, "timeout": timeout, "trust_env": False,
                "headers": {"Authorization": self.authorization},
                "verify": self.ssl_context() or True}


@functools.lru_cache(maxsize=8)
def trusting(authority_pem: str) -> ssl.SSLContext:
    """A client context that trusts the certificates `authority_pem` signed, and no other,
    and checks the name asked for (one per authority: a context is made once)."""
    return ssl.create_default_context(cadata=authority_pem)


def new_key_and_request() -> tuple[bytes, str]:
    """A new engine key (EC, P-256; PEM) and a signing request for it (PEM). The request
    names nothing: the control plane puts in the name the engine may carry."""
    key = ec.generate_private_key(ec.SECP256R1())
    request = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrun engine")]))
               .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, request.public_bytes(serialization.Encoding.PEM).decode()


def write_key_and_certificate(folder: Path, *, key_pem: bytes, certificate_pem: str
                              ) -> tuple[Path, Path]:
    """Write the engine's key (readable by its owner alone) and certificate into `folder`
    (the replica's own directory); returns their paths. Files of an earlier start are
    replaced, never written through: the folder is the engine's to write, and a link it
    left there must not send the agent's writes elsewhere."""
    key, certificate = folder / KEY_FILE, folder / CERTIFICATE_FILE
    folder.mkdir(parents=True, exist_ok=True)
    _write_new(key, key_pem)
    _write_new(certificate, certificate_pem.encode())
    return key, certificate


def _write_new(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, 0o600), "wb") as file:
        file.write(data)
