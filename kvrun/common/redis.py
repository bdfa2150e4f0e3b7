"""The process's Redis client for kvrun's own keys (streams, channels, counters).

Django's cache covers get/set; this is for what the cache API cannot express.
"""

from functools import cache

import redis
from django.conf import settings


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, **settings.REDIS_OPTIONS)
