"""Enrolment: join tokens an operator makes, the credential a node's agent exchanges one for,
and revoking a node.

A node's whole configuration is the control plane's URL and a join token. The token names
the node, is used once and expires within minutes; the credential it buys is the node's own,
rotatable by its agent and revocable by an operator. Only digests of either are stored.
"""

import re
import secrets
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from accounts.models import User
from endpoints.dispatch import reconcile_after_commit
from endpoints.models import Endpoint, Node, NodeState, Replica
from endpoints.states import ON_NODE, State
from engine.devices import HostResources
from fleet.models import JoinToken, NodeCredential
from fleet.reports import do_register_node
from kvrun.common.digests import secret_digest

JOIN_TOKEN_PREFIX = "kvj_"
CREDENTIAL_PREFIX = "kvn_"
JOIN_TOKEN_LIFETIME = timedelta(minutes=15)
JOIN_TOKEN_LONGEST_LIFETIME = timedelta(days=1)
# How stale a credential's last use may be shown: a node calls several times a second.
LAST_USED_PRECISION = timedelta(minutes=1)
# A host name: a node's name is also its agent's queue and a folder's part.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class EnrolmentRefused(Exception):
    """The join token is unknown, used or expired; the message says what to do."""


def _new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def do_create_join_token(*, node_name: str, valid_for: timedelta = JOIN_TOKEN_LIFETIME,
                         created_by: User | None = None) -> tuple[JoinToken, str]:
    """A join token for the node `node_name` (a host name: letters, digits, `.`, `_`, `-`),
    valid for `valid_for` (at most a day). Returns the row and the secret, which is shown
    once and stored nowhere. Raises ValueError for a bad name or lifetime."""
    if not NODE_NAME.fullmatch(node_name):
        raise ValueError(f"{node_name!r} is not a node name: use up to 100 letters, digits, "
                         "'.', '_' or '-', starting with a letter or digit")
    if not timedelta(0) < valid_for <= JOIN_TOKEN_LONGEST_LIFETIME:
        raise ValueError("a join token is valid for more than 0 seconds and at most a day")
    secret = _new_secret(JOIN_TOKEN_PREFIX)
    now = timezone.now()
    token = JoinToken.objects.create(node_name=node_name, digest=secret_digest(secret),
                                     created_at=now, expires_at=now + valid_for,
                                     created_by=created_by)
    return token, secret


def do_enrol_node(*, join_token: str, resources: HostResources, address: str,
                  model_cache_bytes: int) -> tuple[Node, str]:
    """Exchange a join token for the node it names and a credential of the node's own.

    The token is spent by a conditional update, so two agents racing with one token get
    one node. Enrolling a node that exists (a reinstalled host, a revoked node let back)
    revokes its earlier credentials: whoever held them is refused from now on. Returns the
    node, registered as do_register_node does, and the credential's secret, which is stored
    nowhere. Raises EnrolmentRefused."""
    now = timezone.now()
    with transaction.atomic():
        digest = secret_digest(join_token)
        if JoinToken.objects.filter(digest=digest, used_at=None, expires_at__gt=now).update(
                used_at=now) != 1:
            raise EnrolmentRefused(
                "This join token is unknown, used or expired; ask an operator for a new one "
                "(manage.py node_join_token NAME, or the console's join tokens).")
        token = JoinToken.objects.get(digest=digest)
        node = Node.objects.select_for_update().filter(name=token.node_name).first()
        if node is not None:
            NodeCredential.objects.filter(node=node, revoked_at=None).update(revoked_at=now)
            if node.state == NodeState.REVOKED:
                Node.objects.filter(id=node.id).update(state=NodeState.LOST)
        node = do_register_node(name=token.node_name, resources=resources, address=address,
                                model_cache_bytes=model_cache_bytes)
        secret = _new_secret(CREDENTIAL_PREFIX)
        NodeCredential.objects.create(node=node, digest=secret_digest(secret), created_at=now)
    return node, secret


def node_for_credential(*, secret: str) -> Node | None:
    """The node whose live credential `secret` is; None for any other secret (unknown,
    revoked, or of a revoked node). The first use of a rotated credential revokes the
    node's older ones."""
    if not secret.startswith(CREDENTIAL_PREFIX):
        return None
    credential = (NodeCredential.objects.select_related("node")
                  .filter(digest=secret_digest(secret), revoked_at=None)
                  .exclude(node__state=NodeState.REVOKED).first())
    if credential is None:
        return None
    now = timezone.now()
    if credential.first_used_at is None and NodeCredential.objects.filter(
            id=credential.id, first_used_at=None).update(first_used_at=now, last_used_at=now):
        NodeCredential.objects.filter(node_id=credential.node_id, revoked_at=None,
                                      created_at__lt=credential.created_at).update(revoked_at=now)
    elif credential.last_used_at is None or now - credential.last_used_at > LAST_USED_PRECISION:
        NodeCredential.objects.filter(id=credential.id).update(last_used_at=now)
    return credential.node


def do_rotate_node_credential(*, node: Node) -> str:
    """A new credential for `node`; its current ones stay valid until the new one is first
    used (node_for_credential). Returns the new secret."""
    secret = _new_secret(CREDENTIAL_PREFIX)
    NodeCredential.objects.create(node=node, digest=secret_digest(secret))
    return secret


def do_revoke_node(*, node_id: int) -> int:
    """Refuse the node's agent from now on and replace its replicas elsewhere: its
    credentials are revoked, the node is marked revoked (scheduling skips it, and neither
    heartbeats nor registrations bring it back; only a new enrolment does), and each endpoint
    with a replica on it is reconciled, which settles those replicas and places new ones.
    Their engines may still run on the node, but no gateway routes to them. Returns how many
    replicas were on the node."""
    now = timezone.now()
    with transaction.atomic():
        Node.objects.filter(id=node_id).update(state=NodeState.REVOKED)
        NodeCredential.objects.filter(node_id=node_id, revoked_at=None).update(revoked_at=now)
        on_node = Replica.objects.filter(node_id=node_id, state__in=ON_NODE | {State.STOPPING})
        for endpoint in Endpoint.objects.filter(
                id__in=on_node.values("endpoint_id")).distinct():
            reconcile_after_commit(endpoint)
        return on_node.count()
