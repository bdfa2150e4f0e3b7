"""How a node proves who it is. A join token is made by an operator for one node name and
used once; the node's agent exchanges it for a credential of its own. Only digests of either
secret are stored (kvrun.common.digests.secret_digest)."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from endpoints.models import Node, Region


class JoinToken(models.Model):
    """A one-time, short-lived secret with which a node's agent enrols as `node_name`."""

    node_name = models.CharField(max_length=100)
    # Where the node is, in the operator's word: the node takes it at enrolment.
    region = models.ForeignKey(Region, null=True, blank=True, on_delete=models.PROTECT,
                               related_name="+")
    zone = models.CharField(max_length=40, blank=True)
    # Made by an organisation's owner: the node is that organisation's own.
    organization = models.ForeignKey("accounts.Organization", null=True, blank=True,
                                     on_delete=models.CASCADE, related_name="+")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"join token for {self.node_name}"


class NodeCredential(models.Model):
    """A node agent's secret for the node channel. Rotating makes a new one; the older ones
    of the node stay valid until the new one is first used, so that a rotation whose answer
    was lost does not lock the node out."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="credentials")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    first_used_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # An operator asked the node to rotate it: its agent does at its next heartbeat.
    rotation_asked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"credential of {self.node.name}"


class CertificateAuthority(models.Model):
    """The control plane's authority for engines' TLS certificates (fleet.certificates):
    one row, its key sealed (kvrun.common.sealing), so that every web process signs with
    it and a stolen table alone signs nothing."""

    ONLY = 1

    id = models.PositiveSmallIntegerField(primary_key=True, default=ONLY)
    certificate_pem = models.TextField()
    key_sealed = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return "engine certificate authority"
