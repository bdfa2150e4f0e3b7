import time

from django.core.management.base import BaseCommand, CommandError, CommandParser

from endpoints.selectors import node_takes_replicas


class Command(BaseCommand):
    help = (
        "Wait until the node NAME has registered and takes replicas (exit 0), or fail after "
        "--timeout seconds. An endpoint is sized for the hardware online when it is created: "
        "scripts that start a node and then create endpoints for it wait here between the two."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The node's name, as its agent was given it.")
        parser.add_argument("--timeout", type=float, default=120.0)

    def handle(self, *args: object, name: str, timeout: float, **options: object) -> None:
        deadline = time.monotonic() + timeout
        while not node_takes_replicas(name=name):
            if time.monotonic() > deadline:
                raise CommandError(f"node {name} has not registered within {timeout:.0f} s; "
                                   "its agent's output above says why")
            time.sleep(0.5)
