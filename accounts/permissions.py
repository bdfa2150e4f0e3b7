from typing import TYPE_CHECKING

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from accounts.principals import KeyPrincipal

if TYPE_CHECKING:  # rest_framework.views imports the permission settings: no cycle at run time
    from rest_framework.views import APIView


class ManageScopeForKeys(BasePermission):
    """The management API refuses `inference` keys; they are for the gateway only."""

    message = (
        "This API key has the inference scope; management calls need a key with the manage scope."
    )

    def has_permission(self, request: Request, view: "APIView") -> bool:
        user = request.user
        return not isinstance(user, KeyPrincipal) or user.can_manage


class SignedInUser(BasePermission):
    """Actions that belong to a person (creating organisations, accepting invites), not a key."""

    message = "This action needs a signed-in user; API keys cannot do it."

    def has_permission(self, request: Request, view: "APIView") -> bool:
        return not isinstance(request.user, KeyPrincipal)
