"""What Django's debug page may show (the launcher runs with DEBUG on)."""

import re
from types import FrameType
from typing import Any

from django.http import HttpRequest, QueryDict
from django.views.debug import SafeExceptionReporterFilter


class SettingsFilter(SafeExceptionReporterFilter):
    """Django's own, which hides settings named like keys, tokens and passwords, and also
    every URL and cache location (REDIS_URL, CELERY_BROKER_URL and the cache's LOCATION hold
    the Redis password); and, by the same names, a frame's local variables and a form's
    fields, such as a hub access token on its way to the hub."""

    hidden_settings = re.compile(
        "API|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|URL|LOCATION", flags=re.IGNORECASE)

    def get_traceback_frame_variables(self, request: HttpRequest | None,
                                      tb_frame: FrameType) -> Any:
        return [(name, self.cleansed_substitute if self.hidden_settings.search(name) else value)
                for name, value in super().get_traceback_frame_variables(request, tb_frame)]

    def get_post_parameters(self, request: HttpRequest | None) -> Any:
        parameters = super().get_post_parameters(request)
        if not isinstance(parameters, QueryDict):
            return parameters
        cleansed = parameters.copy()
        for name in cleansed:
            if self.hidden_settings.search(name):
                cleansed[name] = self.cleansed_substitute
        return cleansed
