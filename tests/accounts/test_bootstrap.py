"""`make run`'s first words: the admin's password once, stored only as a hash, and a fresh
24-hour manage key each run, the one before it revoked."""

import io
import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from accounts.models import APIKey, Scope, User

pytestmark = pytest.mark.django_db


def bootstrap() -> str:
    out = io.StringIO()
    call_command("bootstrap_demo", stdout=out)
    return out.getvalue()


def test_the_first_run_prints_the_admin_password_once_and_stores_only_its_hash() -> None:
    first = bootstrap()
    password = re.search(r"password: (\S+)", first)[1]
    admin = User.objects.get(email="admin@example.com")

    assert admin.password.startswith("argon2$") and password not in admin.password
    assert admin.check_password(password) and admin.is_superuser

    again = bootstrap()

    assert "password shown at first run" in again and password not in again


def test_each_run_prints_a_fresh_manage_key_for_24_hours_and_revokes_the_last() -> None:
    first = re.search(r"Bearer (kvr_\w+)", bootstrap())[1]
    second = re.search(r"Bearer (kvr_\w+)", bootstrap())[1]

    live = APIKey.objects.get(revoked_at=None)
    assert second != first and live.last_four == second[-4:] and live.scope == Scope.MANAGE
    expected = timezone.now() + timedelta(hours=24)
    assert abs(live.expires_at - expected) < timedelta(minutes=1)
    assert APIKey.objects.get(last_four=first[-4:]).revoked_at is not None
