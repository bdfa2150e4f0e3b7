"""The one Celery app: the control worker, beat and every node agent use it."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")

app = Celery("kvrun")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
