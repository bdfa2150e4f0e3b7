from django.apps import AppConfig


class EngineConfig(AppConfig):
    """Registers the node agent's Celery tasks; engine/ has no models."""

    name = "engine"
    verbose_name = "Engine"
