"""Secrets shown once (API keys, invite tokens) and the peppered HMACs stored for them."""

import hashlib
import hmac
import secrets
import string

from django.conf import settings

API_KEY_PREFIX = "kvr_"
# 43 base62 characters carry 256 bits.
_SECRET_LENGTH = 43
_ALPHABET = string.ascii_letters + string.digits


def new_api_key_secret() -> str:
    return API_KEY_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(_SECRET_LENGTH))


def new_invite_token() -> str:
    return secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    """HMAC-SHA256 under the server-side pepper: a stolen table alone reveals no usable key."""
    return hmac.new(
        settings.KVRUN_KEY_PEPPER.encode(), secret.encode(), hashlib.sha256
    ).hexdigest()


def visible_prefix(secret: str) -> str:
    return secret[: len(API_KEY_PREFIX) + 4]
