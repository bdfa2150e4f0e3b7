from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fleet.enrolment import JOIN_TOKEN_LIFETIME, do_create_join_token


class Command(BaseCommand):
    help = ("Make a one-time join token for the node NAME and print it: the node's agent "
            "exchanges it at /node/v1/enrol for a credential of its own.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The node's name (a host name).")
        parser.add_argument("--minutes", type=float,
                            default=JOIN_TOKEN_LIFETIME.total_seconds() / 60,
                            help="How long it may be used (at most a day).")

    def handle(self, *args: object, name: str, minutes: float, **options: object) -> None:
        try:
            token, secret = do_create_join_token(node_name=name,
                                                 valid_for=timedelta(minutes=minutes))
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stderr.write(f"join token for node {name}, valid until "
                          f"{token.expires_at:%Y-%m-%d %H:%M:%S} UTC, shown once:")
        self.stdout.write(secret)
