from django.apps import AppConfig


class ScalingConfig(AppConfig):
    name = "scaling"
    verbose_name = "Autoscaling"
