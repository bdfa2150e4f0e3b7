from celery import shared_task
from django.utils import timezone

from telemetry.services import do_advise_endpoints, do_downsample_samples


@shared_task(name="telemetry.downsample_samples", ignore_result=True)
def downsample_samples() -> None:
    do_downsample_samples(now=timezone.now())


@shared_task(name="telemetry.advise", ignore_result=True)
def advise() -> None:
    do_advise_endpoints(now=timezone.now())
