from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.models import Organization
from endpoints.models import Region
from fleet.enrolment import JOIN_TOKEN_LIFETIME, do_create_join_token


class Command(BaseCommand):
    help = ("Make a one-time join token for the node NAME and print it: the node's agent "
            "exchanges it at /node/v1/enrol for a credential of its own.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The node's name (a host name).")
        parser.add_argument("--minutes", type=float,
                            default=JOIN_TOKEN_LIFETIME.total_seconds() / 60,
                            help="How long it may be used (at most a day).")
        parser.add_argument("--region", default="",
                            help="The slug of the region the node is in (the console's "
                                 "regions); none by default.")
        parser.add_argument("--zone", default="", help="Its zone within the region.")
        parser.add_argument("--organization", default="",
                            help="The slug of the organisation whose own node it is (only its "
                                 "endpoints run there); none by default: a shared node.")

    def handle(self, *args: object, name: str, minutes: float, region: str, zone: str,
               organization: str, **options: object) -> None:
        owner = Organization.objects.filter(slug=organization).first() if organization else None
        if organization and owner is None:
            raise CommandError(f"No organisation {organization!r}.")
        found = Region.objects.filter(slug=region).first() if region else None
        if region and found is None:
            known = ", ".join(Region.objects.values_list("slug", flat=True)) or "none yet"
            raise CommandError(f"No region {region!r} (regions: {known}); an operator adds "
                               "regions in the console.")
        try:
            token, secret = do_create_join_token(node_name=name, region=found, zone=zone,
                                                 organization=owner,
                                                 valid_for=timedelta(minutes=minutes))
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stderr.write(f"join token for node {name}, valid until "
                          f"{token.expires_at:%Y-%m-%d %H:%M:%S} UTC, shown once:")
        self.stdout.write(secret)
