import uuid

from django.contrib.auth.models import AbstractBaseUser, BaseUserManager, PermissionsMixin
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils import timezone


class UserManager(BaseUserManager["User"]):
    use_in_migrations = True

    def create_user(self, email: str, password: str | None = None, **fields: object) -> "User":
        user = self.model(email=self.normalize_email(email).lower(), **fields)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def create_superuser(self, email: str, password: str | None = None, **fields: object) -> "User":
        # An operator made on the command line vouches for their own address.
        fields.update(is_staff=True, is_superuser=True, email_verified_at=timezone.now())
        return self.create_user(email, password, **fields)


class User(AbstractBaseUser, PermissionsMixin):
    """A person who signs in with an email address (stored lower-cased)."""

    email = models.EmailField(max_length=254, unique=True)
    name = models.CharField(max_length=150, blank=True)
    is_active = models.BooleanField(default=True)
    is_staff = models.BooleanField(default=False)
    date_joined = models.DateTimeField(default=timezone.now)
    # When the person opened the link kvrun mailed to this address; nothing they own may
    # hold hardware before it (sign-up is self-service: an unverified address costs nothing).
    email_verified_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When the address was confirmed from kvrun's link; empty until then. "
                  "Operators may set it for a person they vouch for.")

    objects = UserManager()

    USERNAME_FIELD = "email"
    EMAIL_FIELD = "email"
    REQUIRED_FIELDS: list[str] = []

    def __str__(self) -> str:
        return self.email

    def save(self, *args: object, **kwargs: object) -> None:
        # Stored lower-cased everywhere (forms, admin, API), so uniqueness ignores case.
        self.email = self.email.strip().lower()
        super().save(*args, **kwargs)


class Role(models.TextChoices):
    OWNER = "owner"
    ADMIN = "admin"
    MEMBER = "member"


MANAGER_ROLES = frozenset({Role.OWNER, Role.ADMIN})


class Organization(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=60, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    members = models.ManyToManyField(User, through="Membership", related_name="organizations")
    max_concurrent_requests = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Inference requests in flight at once; empty means the deployment's default.")
    # Quotas; empty means the deployment's default (KVRUN_ORG_MAX_*). Operators raise them.
    max_endpoints = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Endpoints it may have, running or stopped; empty means the deployment's "
                  "default.")
    max_gpus = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="GPUs its running endpoints may hold at their most replicas (CPU engines "
                  "count as replicas only); empty means the deployment's default.")
    max_replicas = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Replicas its running endpoints may scale to, all together; empty means the "
                  "deployment's default.")
    gpus_approved = models.BooleanField(
        default=False,
        help_text="Where kvrun takes payment: may run GPU endpoints with no payment method on "
                  "file (an operator vouches for it, invoicing it some other way).")
    billing_hold = models.TextField(
        blank=True, help_text="Why its endpoints may not run (a spend cap reached), as the "
                              "gateway and the dashboard tell its people; empty when they may.")

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE,
                                     related_name="memberships")
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "user"],
                                    name="accounts_membership_unique")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} ({self.role})"


class Invite(models.Model):
    """A single-use link to join an organisation; only the token's HMAC is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="invites")
    email = models.EmailField(max_length=254, blank=True)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    token_digest = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.ForeignKey(User, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"invite to {self.organization} ({self.role})"

    @property
    def state(self) -> str:
        if self.accepted_at:
            return "accepted"
        if self.revoked_at:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "pending"


class Scope(models.TextChoices):
    INFERENCE = "inference"
    MANAGE = "manage"


class KeyPurpose(models.TextChoices):
    API = "api", "API"
    # Made by the dashboard for one member's playground on one endpoint; never shown.
    PLAYGROUND = "playground", "playground"


# The largest value the limits' columns hold (PostgreSQL's integer).
LARGEST_LIMIT = 2**31 - 1


class APIKey(models.Model):
    """An organisation's API key. The secret is shown once; only its HMAC is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE,
                                     related_name="api_keys")
    name = models.CharField(max_length=100)
    scope = models.CharField(max_length=10, choices=Scope.choices)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=12, editable=False)
    last_four = models.CharField(max_length=4, editable=False)
    # Endpoints, or one LoRA adapter of an endpoint as `<endpoint>:<adapter>`.
    endpoint_names = ArrayField(models.CharField(max_length=127), default=list, blank=True)
    purpose = models.CharField(max_length=10, choices=KeyPurpose.choices, default=KeyPurpose.API)
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty means the deployment's default.")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Prompt and completion tokens; empty means the default.")
    created_by = models.ForeignKey(User, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The dashboard form's own token: the same form sent twice (a reload) creates one key.
    creation_token = models.CharField(max_length=32, null=True, unique=True, editable=False)

    class Meta:
        verbose_name = "API key"
        indexes = [models.Index(fields=["organization", "created_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…{self.last_four})"

    @property
    def masked(self) -> str:
        return f"{self.prefix}…{self.last_four}"

    @property
    def state(self) -> str:
        if self.revoked_at:
            return "revoked"
        if self.expires_at and self.expires_at <= timezone.now():
            return "expired"
        return "active"
