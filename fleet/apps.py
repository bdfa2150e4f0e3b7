from django.apps import AppConfig


class FleetConfig(AppConfig):
    """The control plane's side of its nodes: enrolment with join tokens, each node's own
    credential, and what node agents report about their nodes."""

    name = "fleet"
    verbose_name = "Fleet"
