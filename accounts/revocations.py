"""A revoked key reaches every gateway at once: its digest is published on a Redis channel,
and each gateway drops the key from its memory when it hears it."""

from kvrun.common.redis import redis_client

KEY_REVOKED_CHANNEL = "kvrun:apikey-revoked"


def announce_key_revoked(digest: str) -> None:
    redis_client().publish(KEY_REVOKED_CHANNEL, digest)
