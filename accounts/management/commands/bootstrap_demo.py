from datetime import timedelta

from django.conf import settings
from django.core.management.base import BaseCommand
from django.utils import timezone

from accounts.services import do_prepare_demo


class Command(BaseCommand):
    help = (
        "Create the demo organisation and admin user on first run (printing the password once), "
        "and print a fresh 24-hour API key for the quickstart curl line."
    )

    def handle(self, *args: object, **options: object) -> None:
        demo = do_prepare_demo(key_lifetime=timedelta(hours=24))
        base = settings.KVRUN_BASE_URL.rstrip("/")
        if demo.password:
            self.stdout.write(
                "\n  Admin user (shown once, stored only as a hash):\n"
                f"    email:    {demo.user.email}\n    password: {demo.password}\n"
                f"    sign in at {base}/login/ or {base}/admin/\n"
            )
        else:
            self.stdout.write(f"\n  Admin user: {demo.user.email} (password shown at first run)")
        self.stdout.write(
            f"  Quickstart key for {demo.organization.slug}, valid until "
            f"{(timezone.now() + timedelta(hours=24)):%Y-%m-%d %H:%M} UTC:\n"
            f"    curl -H 'Authorization: Bearer {demo.secret}' {base}/api/v1/models/\n"
        )
