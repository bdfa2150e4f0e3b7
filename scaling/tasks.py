from celery import shared_task
from django.utils import timezone

from scaling.services import do_scale_idle_endpoints_to_zero


@shared_task(name="scaling.autoscale", ignore_result=True)
def autoscale() -> None:
    do_scale_idle_endpoints_to_zero(now=timezone.now())
