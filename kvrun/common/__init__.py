"""What every app shares and that imports none of them: the API's conventions, Redis, digests,
client addresses, probes, units. The rest of `kvrun` composes the apps (settings, URLs, ASGI,
Celery, the launcher)."""
