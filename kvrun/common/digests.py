"""Every HMAC kvrun keys with its pepper (KVRUN_KEY_PEPPER), in one place.

Each use hashes a message of its own shape (a `kvr_` secret, `engine:<replica>:node:<id>`,
`playground:<key>`, `cache-salt:<organisation>`), so no value of one kind can stand for
another.
"""

import functools
import hashlib
import hmac
from uuid import UUID

from django.conf import settings


def _keyed(message: str) -> str:
    return hmac.new(settings.KVRUN_KEY_PEPPER.encode(), message.encode(),
                    hashlib.sha256).hexdigest()


def secret_digest(secret: str) -> str:
    """What is stored for an API key or invite token: a stolen table alone reveals no secret."""
    return _keyed(secret)


def engine_api_key(*, replica_id: UUID | str, node_id: int) -> str:
    """The key a replica's engine on node `node_id` demands; derived, so that the node agent
    that starts the engine and every gateway that calls it agree on it and nothing stores it.
    The node is part of it: a replica that restarts on another node after a failure keeps its
    id, and the node it left must not know the key it serves with now."""
    return _keyed(f"engine:{replica_id}:node:{node_id}")


def playground_secret(key_id: UUID | str) -> str:
    """The secret of a dashboard playground key, derived like an engine's key: the dashboard
    recomputes it for each message, and neither the browser nor any store ever holds it."""
    return "kvr_" + _keyed(f"playground:{key_id}")[:43]


@functools.lru_cache(maxsize=100_000)
def cache_salt(organization_id: object, key_id: object = None) -> str:
    """A vLLM cache salt: the organisation's, whose cached prefixes are reused for it alone,
    or, given `key_id`, that API key's alone within it."""
    scope = f"cache-salt:{organization_id}" + (f":key:{key_id}" if key_id else "")
    return _keyed(scope)[:32]
