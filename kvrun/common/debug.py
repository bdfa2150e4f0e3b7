"""What Django's debug page may show of the settings (the launcher runs with DEBUG on)."""

import re

from django.views.debug import SafeExceptionReporterFilter


class SettingsFilter(SafeExceptionReporterFilter):
    """Django's own, which hides keys, tokens and passwords by name, and also every URL and
    cache location: REDIS_URL, CELERY_BROKER_URL and the cache's LOCATION hold the Redis
    password."""

    hidden_settings = re.compile(
        "API|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|URL|LOCATION", flags=re.IGNORECASE)
