"""Secrets kvrun must read back (a hub access token), sealed at rest.

Fernet (AES-128-CBC with an HMAC-SHA256 tag, from `cryptography`) with a key that is never
in the database: KVRUN_SEALING_KEY, or one derived from SECRET_KEY where it is not set. A
stolen table alone opens nothing; a value altered in the table fails to open.
"""

import base64
import functools

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

__all__ = ["InvalidToken", "seal", "unseal"]


@functools.cache
def _fernet(material: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=b"kvrun sealing").derive(material.encode())
    return Fernet(base64.urlsafe_b64encode(key))


def _key() -> Fernet:
    return _fernet(settings.KVRUN_SEALING_KEY or settings.SECRET_KEY)


def seal(secret: str) -> str:
    return _key().encrypt(secret.encode()).decode()


def unseal(sealed: str) -> str:
    """The secret; raises InvalidToken when `sealed` was altered or sealed with another key."""
    return _key().decrypt(sealed.encode()).decode()
