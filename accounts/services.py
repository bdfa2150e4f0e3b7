"""Writes for accounts. Every state change goes through a do_<verb>_<noun> function here.

Services raise django.core.exceptions.ValidationError (keyed by field) for input a person
must change, and PermissionDenied when the caller's role does not allow the change.
"""

import logging
import secrets
import smtplib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core import signing
from django.core.cache import cache
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.mail import send_mail
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.text import slugify

from accounts import tokens
from accounts.models import (
    MANAGER_ROLES,
    APIKey,
    Invite,
    KeyPurpose,
    Membership,
    Organization,
    Role,
    Scope,
    User,
)
from accounts.revocations import announce_key_revoked
from accounts.selectors import key_cache_name
from kvrun.common.digests import playground_secret, secret_digest

logger = logging.getLogger(__name__)

QUICKSTART_KEY_NAME = "quickstart"
EMAIL_VERIFICATION_SALT = "kvrun.accounts.email-verification"


def do_sign_up(*, email: str, password: str, name: str = "", organization_name: str = "") -> User:
    """Create a user and an organisation that the user owns, and mail them the link that
    confirms their address (do_send_email_verification). Nothing is written on error."""
    email = (email or "").strip().lower()
    errors: dict[str, list[str]] = {}
    try:
        validate_email(email)
    except ValidationError:
        errors["email"] = ["Enter a valid email address, such as ada@example.com."]
    try:
        validate_password(password or "", user=User(email=email, name=name))
    except ValidationError as exc:
        errors["password"] = list(exc.messages)
    if errors:
        raise ValidationError(errors)
    try:
        with transaction.atomic():
            user = User.objects.create_user(email=email, password=password, name=name.strip())
            do_create_organization(
                user=user, name=organization_name.strip() or f"{email.split('@')[0]}'s team"
            )
    except IntegrityError:
        raise ValidationError(
            {"email": ["An account with this email already exists; sign in instead."]}
        ) from None
    do_send_email_verification(user=user)
    return user


def do_send_email_verification(*, user: User) -> None:
    """Mail `user`, once the transaction commits, a link that confirms their address
    (do_verify_email). It is signed, names the address, and works for
    KVRUN_EMAIL_VERIFICATION_DAYS; nothing is stored. A mail that cannot be sent is logged."""
    token = signing.dumps({"user": user.pk, "email": user.email}, salt=EMAIL_VERIFICATION_SALT)
    body = render_to_string("accounts/verify_email.txt", {
        "email": user.email, "days": settings.KVRUN_EMAIL_VERIFICATION_DAYS,
        "link": settings.KVRUN_BASE_URL.rstrip("/") + reverse("verify-email", args=[token])})
    transaction.on_commit(lambda: _send_confirmation(body, user.email))


def _send_confirmation(body: str, address: str) -> None:
    # A mail server that fails must not fail the sign-up that was just committed: the
    # dashboard's button sends the link again.
    try:
        send_mail("Confirm your email address for kvrun", body, None, [address])
    except (smtplib.SMTPException, OSError):
        logger.exception("the confirmation mail to %s could not be sent", address)


def do_verify_email(*, token: str) -> User:
    """Mark the address that `token` (from do_send_email_verification) names as confirmed,
    once; a link opened again changes nothing. Raises ValidationError, saying what to do,
    for a link that is not kvrun's, has expired, or names an address that is no longer the
    account's."""
    try:
        claim = signing.loads(token, salt=EMAIL_VERIFICATION_SALT,
                              max_age=timedelta(days=settings.KVRUN_EMAIL_VERIFICATION_DAYS))
    except signing.SignatureExpired:
        raise ValidationError("This link has expired. Sign in, and have a new one sent from "
                              "the dashboard.") from None
    except signing.BadSignature:
        raise ValidationError("This is not a link kvrun sent: copy the whole link from the "
                              "mail, or have a new one sent from the dashboard.") from None
    user = User.objects.filter(pk=claim["user"], email=claim["email"]).first()
    if user is None:
        raise ValidationError("This link is for an address that no longer has an account "
                              "here.")
    User.objects.filter(pk=user.pk, email_verified_at=None).update(
        email_verified_at=timezone.now())
    user.refresh_from_db(fields=["email_verified_at"])
    return user


def do_create_organization(*, user: User, name: str) -> Organization:
    """Create an organisation with a unique slug derived from `name`, owned by `user`.
    Raises ValidationError for an empty name, or when `user` owns
    KVRUN_MAX_OWNED_ORGANIZATIONS already (_refuse_past_owned_cap)."""
    name = name.strip()
    if not name:
        raise ValidationError({"name": ["Give the organisation a name."]})
    base = slugify(name)[:50] or "org"
    with transaction.atomic():
        _refuse_past_owned_cap(user, field="name",
                               whose="You own {most} organisations, the most one person may; "
                                     "use one of them, or ask an operator.")
        slug = base
        while True:
            try:
                with transaction.atomic():
                    organization = Organization.objects.create(name=name, slug=slug)
                break
            except IntegrityError:
                slug = f"{base}-{secrets.token_hex(3)}"
        Membership.objects.create(organization=organization, user=user, role=Role.OWNER)
    return organization


def do_rename_organization(*, organization: Organization, name: str) -> Organization:
    name = name.strip()
    if not name:
        raise ValidationError({"name": ["Give the organisation a name."]})
    Organization.objects.filter(id=organization.id).update(name=name)
    organization.name = name
    return organization


def require_manager(role: str | None, action: str) -> None:
    if role not in MANAGER_ROLES:
        raise PermissionDenied(f"Only owners and admins can {action}; ask one of them.")


def do_create_invite(
    *, organization: Organization, actor_role: str | None, created_by: User | None,
    role: str = Role.MEMBER, email: str = "",
) -> tuple[Invite, str]:
    """Create a single-use invite. Returns the invite and its token, which is not stored."""
    require_manager(actor_role, "invite members")
    if role == Role.OWNER and actor_role != Role.OWNER:
        raise PermissionDenied("Only owners can invite another owner.")
    token = tokens.new_invite_token()
    invite = Invite.objects.create(
        organization=organization,
        email=email.strip().lower(),
        role=role,
        token_digest=secret_digest(token),
        created_by=created_by,
        expires_at=timezone.now() + timedelta(days=settings.KVRUN_INVITE_DAYS),
    )
    # Never the link: whoever reads the log could join with it. It is shown once, to its maker.
    logger.info("invite %s to %s created", invite.id, organization.slug)
    return invite, token


def invite_url(token: str) -> str:
    return f"{settings.KVRUN_BASE_URL.rstrip('/')}/invite/{token}/"


def do_accept_invite(*, token: str, user: User) -> Membership:
    """Use an invite once: the first acceptance wins, a second one is refused. An invite made
    for an email address is refused to anyone signed in with another, and stays usable."""
    now = timezone.now()
    unusable = ValidationError(
        {"token": ["This invite link is invalid, used, revoked or expired; ask for a new one."]}
    )
    invite = Invite.objects.filter(token_digest=secret_digest(token or "")).first()
    if invite is None:
        raise unusable
    if invite.email and invite.email != user.email:
        raise ValidationError({"token": [
            f"This invite is for {invite.email}; sign in as {invite.email} to accept it, or ask "
            f"for an invite to {user.email}."]})
    try:
        with transaction.atomic():
            claimed = Invite.objects.filter(
                id=invite.id, accepted_at=None, revoked_at=None, expires_at__gt=now
            ).update(accepted_at=now, accepted_by=user)
            if claimed != 1:
                raise unusable
            if invite.role == Role.OWNER:
                _refuse_past_owned_cap(user, field="token", whose=(
                    "You own {most} organisations, the most one person may: leave one, or "
                    "ask for an invite as an admin or a member."))
            return Membership.objects.create(
                organization_id=invite.organization_id, user=user, role=invite.role
            )
    except IntegrityError:
        raise ValidationError(
            {"token": ["You are already a member of this organisation."]}
        ) from None


def do_revoke_invite(*, invite: Invite, actor_role: str | None) -> None:
    require_manager(actor_role, "revoke invites")
    Invite.objects.filter(id=invite.id, accepted_at=None, revoked_at=None).update(
        revoked_at=timezone.now()
    )


def do_change_member_role(*, membership: Membership, role: str,
                          actor_role: str | None) -> Membership:
    """Change a member's role. Only owners grant or take away ownership; one owner always
    remains."""
    require_manager(actor_role, "change roles")
    if Role.OWNER in (role, membership.role) and actor_role != Role.OWNER:
        raise PermissionDenied("Only owners can make someone an owner or change an owner's role.")
    with transaction.atomic():
        _lock_owners(membership.organization_id)
        if membership.role == Role.OWNER and role != Role.OWNER:
            _refuse_last_owner(membership, "make another member an owner before changing this role")
        if role == Role.OWNER and membership.role != Role.OWNER:
            _refuse_past_owned_cap(membership.user, field="role", whose=(
                f"{membership.user.email} owns {{most}} organisations, the most one person "
                "may; make them an admin instead."))
        Membership.objects.filter(id=membership.id).update(role=role)
    membership.role = role
    return membership


def do_remove_member(*, membership: Membership, actor_role: str | None, actor: User | None) -> None:
    """Remove a member. Members may remove themselves (leave); owners stay until one remains."""
    leaving = actor is not None and membership.user_id == actor.pk
    if not leaving:
        require_manager(actor_role, "remove members")
        if membership.role == Role.OWNER and actor_role != Role.OWNER:
            raise PermissionDenied("Only owners can remove an owner.")
    with transaction.atomic():
        _lock_owners(membership.organization_id)
        if membership.role == Role.OWNER:
            _refuse_last_owner(membership, "make another member an owner first")
        Membership.objects.filter(id=membership.id).delete()


def _refuse_past_owned_cap(user: User, *, field: str, whose: str) -> None:
    """Raise ValidationError on `field` (`whose`, with {most} filled in) when `user` owns
    KVRUN_MAX_OWNED_ORGANIZATIONS organisations already: each has quotas of its own, so one
    person may not multiply them at will, by creating organisations, by owner invites or by
    promotion. Holds the user's row until the transaction ends, so that two of these at once
    cannot both take the last one."""
    User.objects.select_for_update().filter(id=user.id).first()
    most = settings.KVRUN_MAX_OWNED_ORGANIZATIONS
    if Membership.objects.filter(user=user, role=Role.OWNER).count() >= most:
        raise ValidationError({field: [whose.format(most=most)]})


def _lock_owners(organization_id: object) -> None:
    list(
        Membership.objects.select_for_update()
        .filter(organization_id=organization_id, role=Role.OWNER)
        .values_list("id", flat=True)
    )


def _refuse_last_owner(membership: Membership, advice: str) -> None:
    owners = Membership.objects.filter(organization_id=membership.organization_id, role=Role.OWNER)
    if not owners.exclude(id=membership.id).exists():
        raise ValidationError({"role": [f"An organisation needs an owner: {advice}."]})


KEY_FORM_SENT_AGAIN = "key_form_sent_again"


def do_create_api_key(
    *, organization: Organization, name: str, scope: str, actor_role: str | None,
    created_by: User | None, expires_at: datetime | None = None,
    endpoint_names: Iterable[str] = (), requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None, creation_token: str | None = None,
) -> tuple[APIKey, str]:
    """Create an API key. Returns the row and the secret, which is shown once and never stored.
    A `creation_token` already used (the form that created a key, sent again) creates
    nothing: ValidationError."""
    require_manager(actor_role, "create API keys")
    try:
        validate_key_expiry(expires_at)
    except ValidationError as exc:
        raise ValidationError({"expires_at": exc.messages}) from None
    secret = tokens.new_api_key_secret()
    try:
        with transaction.atomic():
            key = APIKey.objects.create(
                organization=organization,
                name=name.strip(),
                scope=scope,
                digest=secret_digest(secret),
                prefix=tokens.visible_prefix(secret),
                last_four=secret[-4:],
                endpoint_names=sorted(set(endpoint_names)),
                requests_per_minute=requests_per_minute,
                tokens_per_minute=tokens_per_minute,
                created_by=created_by,
                expires_at=expires_at,
                creation_token=creation_token,
            )
    except IntegrityError:
        if creation_token is None or not APIKey.objects.filter(
                creation_token=creation_token).exists():
            raise
        raise ValidationError(
            "This form was sent before and its key created (reloading the page sends it "
            "again): a key's secret is shown only once. If you did not copy it, revoke that key "
            "and create another.", code=KEY_FORM_SENT_AGAIN) from None
    return key, secret


def validate_key_expiry(expires_at: datetime | None) -> None:
    """A key's expiry, when it has one, is in the future (forms check it with their fields)."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError("Choose an expiry in the future, or none.")


def do_issue_playground_key(*, organization: Organization, user: User, actor_role: str | None,
                            endpoint_name: str, lifetime: timedelta) -> APIKey:
    """A short-lived inference key for one person's playground on one endpoint, so that what
    the playground spends is recorded against a key of its own, never another's. Owners and
    admins may have one: the playground spends (and wakes an endpoint at zero), and members
    are read-only. Its secret is `kvrun.common.digests.playground_secret(key.id)`: derived,
    never stored, never shown. Raises PermissionDenied for a member."""
    require_manager(actor_role, "use the playground")
    key = APIKey(organization=organization, name=f"playground: {user.email}"[:100],
                 scope=Scope.INFERENCE, purpose=KeyPurpose.PLAYGROUND,
                 endpoint_names=[endpoint_name], created_by=user,
                 expires_at=timezone.now() + lifetime)
    secret = playground_secret(key.id)
    key.digest, key.prefix, key.last_four = (secret_digest(secret),
                                             tokens.visible_prefix(secret), secret[-4:])
    key.save()
    return key


def do_revoke_api_key(*, key: APIKey, actor_role: str | None) -> bool:
    """Revoke a key at once. Returns False when it was already revoked."""
    require_manager(actor_role, "revoke API keys")
    revoked = APIKey.objects.filter(id=key.id, revoked_at=None).update(revoked_at=timezone.now())
    # Drop the cached identity, here and in every gateway process, so that the very next
    # request is refused.
    cache.delete(key_cache_name(key.digest))
    transaction.on_commit(lambda: announce_key_revoked(key.digest))
    return revoked == 1


def do_touch_api_key(*, key_id: object, used_at: datetime) -> None:
    """Record a key's use; never moves last_used_at backwards, so replays are harmless."""
    APIKey.objects.filter(Q(last_used_at=None) | Q(last_used_at__lt=used_at), id=key_id).update(
        last_used_at=used_at
    )


@dataclass(frozen=True)
class DemoAccess:
    user: User
    organization: Organization
    password: str | None
    secret: str


def do_prepare_demo(*, key_lifetime: timedelta, email: str = "admin@example.com") -> DemoAccess:
    """Make sure the demo admin and organisation exist and mint a short-lived quickstart key.

    The password is generated only when the user is created and returned once; earlier
    quickstart keys are revoked, so at most one is live.
    """
    password = None
    user = User.objects.filter(email=email).first()
    if user is None:
        password = secrets.token_urlsafe(12)
        user = User.objects.create_superuser(email=email, password=password, name="kvrun admin")
    membership = Membership.objects.filter(user=user, role=Role.OWNER).select_related(
        "organization").first()
    if membership is None:
        organization = do_create_organization(user=user, name="Demo")
    else:
        organization = membership.organization
    APIKey.objects.filter(organization=organization, name=QUICKSTART_KEY_NAME,
                          revoked_at=None).update(revoked_at=timezone.now())
    _, secret = do_create_api_key(
        organization=organization, name=QUICKSTART_KEY_NAME, scope=Scope.MANAGE,
        actor_role=Role.OWNER, created_by=user, expires_at=timezone.now() + key_lifetime,
    )
    return DemoAccess(user=user, organization=organization, password=password, secret=secret)


def do_set_billing_hold(*, organization_id: object, reason: str) -> bool:
    """Hold the organisation's endpoints with `reason` (the gateway refuses its requests and
    no endpoint of it may start), or release it with "". Returns whether anything changed."""
    return Organization.objects.filter(id=organization_id).exclude(billing_hold=reason).update(
        billing_hold=reason) == 1
