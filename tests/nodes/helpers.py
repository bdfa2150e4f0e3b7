"""What node tests share: a node agent's channel to the control plane of this process, and
a replica of the demo model on a node."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from django.core import signals
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections

from accounts.models import Role
from endpoints.models import ModelSpec, Node, Replica
from endpoints.policies import EndpointPolicy
from endpoints.services import do_create_endpoint
from fleet.enrolment import do_create_join_token
from nodes.channel import NodeChannel
from tests.factories import organization_with_owner


class ControlPlane(WSGIHandler):
    """Django's WSGI handler as the test client runs it: requests leave the database
    connection open (Django closes it as each request starts and ends, which would end a
    test's transaction under it)."""

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> list[bytes]:
        signals.request_started.disconnect(close_old_connections)
        try:
            response = super().__call__(environ, start_response)
            body = b"".join(response)
            signals.request_finished.disconnect(close_old_connections)
            response.close()
        finally:
            signals.request_started.connect(close_old_connections)
            signals.request_finished.connect(close_old_connections)
        return [body]


def channel_of(node: Node, folder: Path) -> NodeChannel:
    """A channel holding `node`'s credential, enrolled now as its agent would."""
    _, token = do_create_join_token(node_name=node.name)
    channel = NodeChannel(url="http://testserver", credential_file=folder / "credential",
                          transport=httpx.WSGITransport(app=ControlPlane()), retry_for=0)
    channel.join(name=node.name, join_token=token, report={
        "resources": {"devices": [], "cpu_count": node.cpu_count,
                      "memory_bytes": node.memory_bytes, "disk_bytes": node.disk_bytes},
        "address": node.address or "127.0.0.1", "model_cache_bytes": node.model_cache_bytes})
    return channel


def demo_replica(node: Node, state: str) -> Replica:
    """A replica of an endpoint of the demo model on `node`, in `state`."""
    endpoint = do_create_endpoint(
        organization=organization_with_owner("Acme"), actor_role=Role.OWNER, created_by=None,
        name="chat", model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        policy=EndpointPolicy(context_length=2048, concurrency=4))
    return Replica.objects.create(endpoint=endpoint, node=node, state=state)
