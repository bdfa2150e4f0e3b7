from celery import shared_task
from django.utils import timezone

from scaling.services import do_autoscale_endpoints


@shared_task(name="scaling.autoscale", ignore_result=True)
def autoscale() -> None:
    do_autoscale_endpoints(now=timezone.now())
