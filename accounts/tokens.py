"""Secrets shown once: API keys and invite tokens. Only their digests are stored
(kvrun.common.digests.secret_digest)."""

import secrets
import string

API_KEY_PREFIX = "kvr_"
# 43 base62 characters carry 256 bits.
_SECRET_LENGTH = 43
_ALPHABET = string.ascii_letters + string.digits


def new_api_key_secret() -> str:
    return API_KEY_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(_SECRET_LENGTH))


def new_invite_token() -> str:
    return secrets.token_urlsafe(32)


def visible_prefix(secret: str) -> str:
    return secret[: len(API_KEY_PREFIX) + 4]
