"""Reads for accounts: who may see what. Another organisation's objects are never found."""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from django.conf import settings
from django.core.cache import cache
from django.db.models import QuerySet
from django.http import Http404
from django.utils import timezone

from accounts import tokens
from accounts.models import APIKey, Invite, KeyPurpose, Membership, Organization, Role, User
from accounts.principals import KeyIdentity, KeyPrincipal
from kvrun.common.digests import secret_digest

Principal = User | KeyPrincipal


def key_cache_name(digest: str) -> str:
    return f"apikey:{digest}"


def get_key_identity(*, secret: str) -> KeyIdentity | None:
    """The usable key for `secret`, or None. Served from the cache for a few seconds, an
    unknown key too (False there), so that a flood of made-up keys does not reach the
    database for each."""
    if not secret.startswith(tokens.API_KEY_PREFIX):
        return None
    digest = secret_digest(secret)
    cached = cache.get(key_cache_name(digest))
    if cached is None:
        identity = key_identity_from_database(digest=digest)
        cache.set(key_cache_name(digest), identity or False, settings.KVRUN_API_KEY_CACHE_SECONDS)
    else:
        identity = KeyIdentity.from_json(cached) if cached else None
    return identity if identity is not None and identity.is_usable() else None


def key_identity_from_database(*, digest: str) -> KeyIdentity | None:
    """The key with this digest as stored now, usable or not; None when there is none."""
    row = (
        APIKey.objects.filter(digest=digest)
        .values("id", "organization_id", "scope", "expires_at", "revoked_at", "endpoint_names",
                "requests_per_minute", "tokens_per_minute",
                "organization__max_concurrent_requests", "organization__billing_hold")
        .first()
    )
    if row is None:
        return None
    return KeyIdentity(
        id=row["id"],
        organization_id=row["organization_id"],
        scope=row["scope"],
        expires_at=row["expires_at"],
        revoked=row["revoked_at"] is not None,
        endpoint_names=tuple(row["endpoint_names"]),
        requests_per_minute=_or_default(row["requests_per_minute"],
                                        settings.KVRUN_KEY_REQUESTS_PER_MINUTE),
        tokens_per_minute=_or_default(row["tokens_per_minute"],
                                      settings.KVRUN_KEY_TOKENS_PER_MINUTE),
        max_concurrent_requests=_or_default(row["organization__max_concurrent_requests"],
                                            settings.KVRUN_ORG_MAX_CONCURRENT_REQUESTS),
        billing_hold=row["organization__billing_hold"],
    )


def _or_default(value: int | None, default: int) -> int:
    return default if value is None else value


@dataclass(frozen=True)
class Quota:
    """What an organisation may hold (or, from endpoints.selectors, what it holds)."""

    endpoints: int
    gpus: int
    replicas: int


QUOTAS = ("endpoints", "gpus", "replicas")
_DEFAULT_QUOTA_SETTINGS = {"endpoints": "KVRUN_ORG_MAX_ENDPOINTS", "gpus": "KVRUN_ORG_MAX_GPUS",
                           "replicas": "KVRUN_ORG_MAX_REPLICAS"}


@dataclass(frozen=True)
class QuotaScope:
    """One quota (`most`) and the organisations whose endpoints count against it together."""

    most: int
    organization_ids: tuple[UUID, ...]


def quota_scope(*, organization: Organization, owner_ids: Iterable[object],
                quota: str) -> QuotaScope:
    """Where an operator set the organisation's own value of `quota` (one of QUOTAS), the
    organisation alone. Otherwise the deployment's default, counted over every organisation
    its owners (`owner_ids`) own that is on the default too: organisations are free to create,
    so the default bounds a person, not each of their organisations."""
    own = getattr(organization, f"max_{quota}")
    if own is not None:
        return QuotaScope(most=own, organization_ids=(organization.id,))
    pooled = (Organization.objects.filter(memberships__role=Role.OWNER,
                                          memberships__user_id__in=list(owner_ids),
                                          **{f"max_{quota}": None})
              .exclude(id=organization.id).values_list("id", flat=True).distinct())
    return QuotaScope(most=getattr(settings, _DEFAULT_QUOTA_SETTINGS[quota]),
                      organization_ids=(organization.id, *sorted(pooled)))


def organizations_visible_to(*, principal: Principal) -> QuerySet[Organization]:
    if isinstance(principal, KeyPrincipal):
        return Organization.objects.filter(id=principal.key.organization_id)
    return Organization.objects.filter(memberships__user=principal)


def get_organization(*, principal: Principal, slug: str) -> Organization:
    """The organisation with `slug` if the principal belongs to it; 404 otherwise."""
    organization = organizations_visible_to(principal=principal).filter(slug=slug).first()
    if organization is None:
        raise Http404("No organisation with this slug.")
    return organization


def role_of(*, principal: Principal, organization: Organization) -> str | None:
    if isinstance(principal, KeyPrincipal):
        if principal.key.organization_id != organization.id:
            return None
        return Role.ADMIN if principal.can_manage else None
    return (
        Membership.objects.filter(organization=organization, user=principal)
        .values_list("role", flat=True)
        .first()
    )


def memberships_of(*, organization: Organization) -> QuerySet[Membership]:
    return Membership.objects.filter(organization=organization).select_related("user")


def invites_of(*, organization: Organization) -> QuerySet[Invite]:
    return Invite.objects.filter(organization=organization).select_related("created_by")


def playground_key_of(*, user: User, organization: Organization, endpoint_name: str,
                      usable_for: timedelta) -> APIKey | None:
    """The person's playground key for the endpoint with at least `usable_for` of life left."""
    return (APIKey.objects.filter(
        organization=organization, created_by=user, purpose=KeyPurpose.PLAYGROUND,
        endpoint_names=[endpoint_name], revoked_at=None,
        expires_at__gt=timezone.now() + usable_for).order_by("-expires_at").first())


def api_keys_of(*, organization: Organization) -> QuerySet[APIKey]:
    """The keys people made; the playground's own short-lived keys are left out."""
    return APIKey.objects.filter(organization=organization, purpose=KeyPurpose.API
                                 ).select_related("created_by")


def playground_keys_of(*, organization: Organization) -> QuerySet[APIKey]:
    """The playground's short-lived keys of the last day, newest first, with who used them."""
    return (APIKey.objects.filter(organization=organization, purpose=KeyPurpose.PLAYGROUND,
                                  created_at__gte=timezone.now() - timedelta(days=1))
            .select_related("created_by").order_by("-created_at"))
