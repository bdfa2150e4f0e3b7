"""`Authorization: Bearer kvn_…` on the node channel: a node agent's own credential."""

from dataclasses import dataclass

from rest_framework import authentication, exceptions
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.views import APIView

from endpoints.models import Node
from fleet.enrolment import do_use_node_credential


@dataclass(frozen=True)
class NodePrincipal:
    """Stands as request.user for a node agent: it acts for its own node and nothing else."""

    node: Node
    is_authenticated: bool = True


class NodeCredentialAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[NodePrincipal, None] | None:
        keyword, _, secret = authentication.get_authorization_header(request).decode(
            "latin-1").partition(" ")
        if keyword != self.keyword:
            return None
        node = do_use_node_credential(secret=secret.strip())
        if node is None:
            raise exceptions.AuthenticationFailed(
                "This node credential is unknown or revoked; enrol the node anew with a join "
                "token from an operator.")
        return NodePrincipal(node), None

    def authenticate_header(self, request: Request) -> str:
        return f'{self.keyword} realm="node"'


class IsNode(BasePermission):
    """Only a node agent's credential opens the node channel: no user, no API key."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        return isinstance(request.user, NodePrincipal)
