from datetime import datetime

from celery import shared_task

from accounts.services import do_touch_api_key


@shared_task(name="accounts.touch_api_key", ignore_result=True)
def touch_api_key(key_id: str, used_at: str) -> None:
    """Record when a key was last used; a missing key is simply nothing to do."""
    do_touch_api_key(key_id=key_id, used_at=datetime.fromisoformat(used_at))
