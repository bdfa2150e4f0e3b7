from django.apps import AppConfig


class NodesConfig(AppConfig):
    """The node agent: its Celery tasks and the `node_agent` command; nodes/ has no models."""

    name = "nodes"
    verbose_name = "Node agent"
