"""Enrolment: join tokens an operator makes, the credential a node's agent exchanges one for,
and revoking a node.

A join token names the node, is used once and expires within minutes; the credential it buys
is the node's own, rotatable by its agent and revocable by an operator. Only digests of
either are stored.
"""

import re
import secrets
from collections.abc import Collection
from datetime import timedelta

from django.core.exceptions import PermissionDenied
from django.db import connection, transaction
from django.utils import timezone

from accounts.models import Organization, Role, User
from endpoints.dispatch import reconcile_after_commit
from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, Node, NodeState, Region, Replica
from endpoints.states import HOLDING_DEVICES, State
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
# A host name: a node's name is also a folder's part on its host.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
ZONE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,39}")


# New credentials a node may hold unused at once (a rotation whose answer was lost, retried).
CREDENTIALS_WAITING_MOST = 3


class TooManyWaiting(Exception):
    """The node holds as many unused new credentials as it may."""


class EnrolmentRefused(Exception):
    """The join token is unknown, used or expired; the message says what to do."""


def _new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def do_create_join_token(*, node_name: str, valid_for: timedelta = JOIN_TOKEN_LIFETIME,
                         region: Region | None = None, zone: str = "",
                         organization: Organization | None = None,
                         created_by: User | None = None) -> tuple[JoinToken, str]:
    """A join token for the node `node_name` (a host name: letters, digits, `.`, `_`, `-`),
    valid for `valid_for` (at most a day), in `region` and `zone`, and `organization`'s own
    (the node takes them when it enrols; None and "": none, a shared node). Returns the row
    and the secret, which is shown once and stored nowhere. Raises ValueError for a bad
    name, zone or lifetime, or a name that a node of another owner has."""
    if not NODE_NAME.fullmatch(node_name):
        raise ValueError(f"{node_name!r} is not a node name: use up to 100 letters, digits, "
                         "'.', '_' or '-', starting with a letter or digit")
    if not timedelta(0) < valid_for <= JOIN_TOKEN_LONGEST_LIFETIME:
        raise ValueError("a join token is valid for more than 0 seconds and at most a day")
    if zone and (region is None or not ZONE_NAME.fullmatch(zone)):
        raise ValueError(f"{zone!r} is not a zone: a zone is within a region, named by up to "
                         "40 letters, digits or '-'")
    if refusal := owner_refusal(node_name=node_name, organization=organization):
        raise ValueError(refusal)
    secret = _new_secret(JOIN_TOKEN_PREFIX)
    now = timezone.now()
    token = JoinToken.objects.create(node_name=node_name, digest=secret_digest(secret),
                                     created_at=now, expires_at=now + valid_for,
                                     region=region, zone=zone, organization=organization,
                                     created_by=created_by)
    return token, secret


def do_create_own_node_token(*, organization: Organization, actor_role: str | None,
                             created_by: User, node_name: str, region: Region | None = None,
                             zone: str = "") -> tuple[JoinToken, str]:
    """A join token for a node of `organization`'s own, made by one of its owners: as
    do_create_join_token, for JOIN_TOKEN_LIFETIME. Raises PermissionDenied for anyone but
    an owner, ValueError as do_create_join_token."""
    if actor_role != Role.OWNER:
        raise PermissionDenied("Only owners can enrol the organisation's own nodes; ask one "
                               "of them.")
    if Node.objects.filter(name=node_name, state=NodeState.REVOKED).exists():
        # Revoking is the operator's: a node they revoked comes back by their token alone.
        raise ValueError(f"an operator revoked node {node_name}; ask one to let it back")
    return do_create_join_token(node_name=node_name, region=region, zone=zone,
                                organization=organization, created_by=created_by)


def do_enrol_node(*, join_token: str, name: str, resources: HostResources, address: str,
                  model_cache_bytes: int) -> tuple[Node, str]:
    """Exchange a join token for the node it names, `name`, and a credential of the node's
    own; a token made for another name is refused and stays unspent.

    The token is spent by a conditional update, so two agents racing with one token get
    one node. Enrolling a node that exists (a reinstalled host, a revoked node let back)
    revokes its earlier credentials: whoever held them is refused from now on. Returns the
    node, registered as do_register_node does, and the credential's secret, which is stored
    nowhere. Raises EnrolmentRefused."""
    now = timezone.now()
    with transaction.atomic():
        digest = secret_digest(join_token)
        live = JoinToken.objects.filter(digest=digest, used_at=None, expires_at__gt=now)
        if live.filter(node_name=name).update(used_at=now) != 1:
            made_for = live.values_list("node_name", flat=True).first()
            if made_for is not None:
                raise EnrolmentRefused(
                    f"This join token is for node {made_for}, not {name}: start the agent "
                    f"with --name {made_for}, or ask an operator for a token for {name}.")
            raise EnrolmentRefused(
                "This join token is unknown, used or expired; ask an operator for a new one "
                "(manage.py node_join_token NAME, or the console's join tokens).")
        token = JoinToken.objects.select_related("organization").get(digest=digest)
        # Checked again here, the name's enrolments one at a time: the name may have been
        # taken since the token was made, or be taken by another owner's token right now.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"kvrun.node:{name}"])
        if refusal := owner_refusal(node_name=name, organization=token.organization,
                                    waiting_tokens=False):
            raise EnrolmentRefused(f"{refusal}.")
        revoked = Node.objects.filter(name=token.node_name, state=NodeState.REVOKED)
        revoked.update(state=NodeState.LOST)  # let back by this token; registered below
        node = do_register_node(name=token.node_name, resources=resources, address=address,
                                model_cache_bytes=model_cache_bytes)
        Node.objects.filter(id=node.id).update(region=token.region, zone=token.zone,
                                               organization=token.organization)
        node.region, node.zone = token.region, token.zone
        node.organization = token.organization
        # The node's row is held from here (registering locked it): two enrolments of one
        # name at once leave one live credential, the last.
        NodeCredential.objects.filter(node=node, revoked_at=None).update(revoked_at=now)
        secret = _new_secret(CREDENTIAL_PREFIX)
        NodeCredential.objects.create(node=node, digest=secret_digest(secret), created_at=now)
    return node, secret


def owner_refusal(*, node_name: str, organization: Organization | None,
                  waiting_tokens: bool = True) -> str | None:
    """Why a token of `organization` (None: the shared fleet) cannot enrol `node_name`: a
    node of that name belongs to another owner, and enrolling it would take it over; or
    (`waiting_tokens`, for a token to be made) a live token of another owner waits for the
    name."""
    owner_id = organization.id if organization else None
    whose = f"{organization.name}'s" if organization else "a shared node"
    # The owners of the node of that name: none, or one (names are unique).
    owners = list(Node.objects.filter(name=node_name).values_list("organization_id", flat=True))
    if owners and owners[0] != owner_id:
        return f"a node named {node_name} exists and is not {whose}; choose another name"
    if not waiting_tokens:
        return None
    others = JoinToken.objects.filter(node_name=node_name, used_at=None,
                                      expires_at__gt=timezone.now())
    others = (others.exclude(organization=None) if organization is None
              else others.exclude(organization=organization))
    if others.exists():
        return (f"a join token of another owner waits for a node named {node_name}; choose "
                "another name")
    return None


def do_use_node_credential(*, secret: str) -> Node | None:
    """The node whose live credential `secret` is; None for any other secret (unknown,
    revoked, or of a revoked node). Its first use revokes every other credential of the node
    (the one it was rotated from, and any other made meanwhile); its uses are noted to the
    minute."""
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
        NodeCredential.objects.filter(node_id=credential.node_id, revoked_at=None).exclude(
            id=credential.id).update(revoked_at=now)
    elif credential.last_used_at is None or now - credential.last_used_at > LAST_USED_PRECISION:
        NodeCredential.objects.filter(id=credential.id).update(last_used_at=now)
    return credential.node


def do_ask_rotation(*, node_ids: Collection[int]) -> int:
    """Ask the nodes' agents to rotate their credentials: each does at its next heartbeat
    (fleet.selectors.rotation_asked), and the credential it held is revoked once the new
    one is first used. Returns how many live credentials were marked."""
    return NodeCredential.objects.filter(node_id__in=node_ids, revoked_at=None).update(
        rotation_asked_at=timezone.now())


def do_rotate_node_credential(*, node: Node) -> str:
    """A new credential for `node`; the one in use stays valid until the new one is first
    used (do_use_node_credential), which also revokes any other made meanwhile (by whoever
    held the old one). At most CREDENTIALS_WAITING_MOST wait unused: beyond, raises
    TooManyWaiting. Returns the new secret."""
    with transaction.atomic():
        Node.objects.select_for_update().filter(id=node.id).first()  # one rotation at a time
        if NodeCredential.objects.filter(node=node, revoked_at=None,
                                         first_used_at=None).count() >= CREDENTIALS_WAITING_MOST:
            raise TooManyWaiting(
                f"This node has {CREDENTIALS_WAITING_MOST} new credentials it has not used: use "
                "the latest, or ask an operator to enrol the node anew.")
        secret = _new_secret(CREDENTIAL_PREFIX)
        NodeCredential.objects.create(node=node, digest=secret_digest(secret))
    return secret


def do_revoke_node(*, node_id: int) -> int:
    """Refuse the node's agent from now on and replace its replicas elsewhere.

    In one transaction, the node's row held first: the node is marked revoked (scheduling
    skips it, and neither heartbeats nor registrations bring it back), its credentials are
    revoked and its unused join tokens expired (only a join token made after this lets it
    back), and each of its replicas is settled as stopped, so that gateways stop routing to
    it (within their route cache's seconds) though its engine may still run there. Once it
    commits, each endpoint that had one is reconciled, which places a replacement. Returns
    how many replicas were on the node."""
    now = timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(id=node_id)
        Node.objects.filter(id=node_id).update(state=NodeState.REVOKED)
        NodeCredential.objects.filter(node_id=node_id, revoked_at=None).update(revoked_at=now)
        JoinToken.objects.filter(node_name=node.name, used_at=None,
                                 expires_at__gt=now).update(expires_at=now)
    settled = 0
    for replica_id, endpoint_id in Replica.objects.filter(
            node_id=node_id, state__in=HOLDING_DEVICES).values_list("id", "endpoint_id"):
        settled += do_transition_replica(
            replica_id=replica_id, from_states=HOLDING_DEVICES, to_state=State.STOPPED,
            node_id=node_id, stopped_at=timezone.now(),
            message=f"node {node.name} was revoked; rescheduling")
        reconcile_after_commit(Endpoint(id=endpoint_id))
    return settled
