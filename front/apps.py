from django.apps import AppConfig


class FrontConfig(AppConfig):
    """The dashboard's product pages; it has no models and reads and writes through the
    other apps' selectors and services."""

    name = "front"
    verbose_name = "Dashboard"
