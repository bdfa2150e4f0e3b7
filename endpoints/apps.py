from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    verbose_name = "Endpoints, catalogs and nodes"
