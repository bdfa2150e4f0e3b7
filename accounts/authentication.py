"""`Authorization: Bearer kvr_…` for the REST API; keys are looked up by their HMAC."""

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from accounts.principals import KeyIdentity, KeyPrincipal
from accounts.selectors import get_key_identity
from accounts.tasks import touch_api_key


class APIKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[KeyPrincipal, KeyIdentity] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        keyword, _, secret = header.partition(" ")
        if keyword != self.keyword:
            return None
        identity = get_key_identity(secret=secret.strip())
        if identity is None:
            raise exceptions.AuthenticationFailed(
                "This API key is invalid, revoked or expired; create a new key in the dashboard."
            )
        note_key_used(identity)
        return KeyPrincipal(identity), identity

    def authenticate_header(self, request: Request) -> str:
        return f'{self.keyword} realm="api"'


def note_key_used(identity: KeyIdentity) -> None:
    """Queue a last_used_at update at most once per interval per key, off the request path."""
    if cache.add(f"apikey-touched:{identity.id}", 1, settings.KVRUN_API_KEY_TOUCH_SECONDS):
        touch_api_key.delay_on_commit(str(identity.id), timezone.now().isoformat())


class APIKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Describes `Bearer kvr_…` in the OpenAPI schema."""

    target_class = APIKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "kvr_…",
                "description": "An API key with the manage scope."}
