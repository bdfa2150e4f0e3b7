"""Who is calling: a signed-in user, or an organisation's API key."""

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.utils import timezone

from accounts.models import Scope


@dataclass(frozen=True)
class KeyIdentity:
    """What authentication needs to know about an API key; small enough to cache."""

    id: UUID
    organization_id: UUID
    scope: str
    expires_at: datetime | None
    revoked: bool
    endpoint_names: tuple[str, ...] = field(default_factory=tuple)
    # Inference limits with the deployment's defaults applied; 0 means no limit.
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0
    # Why the organisation's endpoints may not serve now (billing); empty when they may.
    billing_hold: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "KeyIdentity":
        """The identity from the JSON that the cache holds (orjson's form of this class)."""
        expires_at = data["expires_at"]
        return cls(**{**data, "id": UUID(data["id"]),
                      "organization_id": UUID(data["organization_id"]),
                      "expires_at": datetime.fromisoformat(expires_at) if expires_at else None,
                      "endpoint_names": tuple(data["endpoint_names"])})

    def is_usable(self) -> bool:
        if self.revoked:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()


class KeyPrincipal:
    """Stands as request.user for a call made with an API key.

    A key acts for its organisation only; a `manage` key has an admin's rights there.
    """

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False
    pk = None

    def __init__(self, key: KeyIdentity) -> None:
        self.key = key

    @property
    def can_manage(self) -> bool:
        return self.key.scope == Scope.MANAGE

    def __str__(self) -> str:
        return f"api key {self.key.id}"
