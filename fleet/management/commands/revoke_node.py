from django.core.management.base import BaseCommand, CommandError, CommandParser

from endpoints.models import Node
from fleet.enrolment import do_revoke_node


class Command(BaseCommand):
    help = ("Revoke the node NAME: its agent is refused from now on and its replicas move to "
            "other nodes. Only a new join token lets it back.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The node's name.")

    def handle(self, *args: object, name: str, **options: object) -> None:
        node = Node.objects.filter(name=name).first()
        if node is None:
            raise CommandError(f"there is no node {name}")
        moved = do_revoke_node(node_id=node.id)
        self.stdout.write(f"node {name} revoked; {moved} replica(s) move to other nodes")
