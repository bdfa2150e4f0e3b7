"""The node channel, /node/v1/: the only way a node agent reaches the control plane. Each view
acts for the calling node alone (fleet.authentication); a replica id of another node is a
404, as for an id that does not exist. Not part of the public API's schema."""

import ipaddress
from typing import Any
from uuid import UUID

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from endpoints.models import Node, NodeState, Replica
from engine.build import EngineBuild
from engine.hub import HubRefusal
from engine.metrics import EngineSnapshot
from fleet import certificates, replicas, selectors, serializers
from fleet.authentication import IsNode, NodeCredentialAuthentication, NodePrincipal
from fleet.enrolment import (
    EnrolmentRefused,
    TooManyWaiting,
    do_enrol_node,
    do_rotate_node_credential,
)
from fleet.reports import (
    NodeRevoked,
    do_record_model_cache,
    do_record_node_build,
    do_record_node_heartbeat,
    do_register_node,
)
from fleet.selectors import NotNow
from kvrun.common.api import AddressRateThrottle, secret_response, validated
from kvrun.common.clients import client_address


class EnrolThrottle(AddressRateThrottle):
    """Guesses at join tokens, per client address (a token carries 256 bits: this only
    keeps a guesser from costing the database; a fleet enrolled at once behind one address
    fits)."""

    scope = "node-enrol"
    rate = "120/hour"


def caller_is_local(request: Request) -> bool:
    """Whether the node calls from the control plane's own host (loopback)."""
    try:
        return ipaddress.ip_address(client_address(request)).is_loopback
    except ValueError:
        return False


def hub_refusal(exc: HubRefusal) -> Response:
    """The hub refused the control plane (pinning a model for the node): its words, a 502."""
    return Response({"error": {"type": "hub_refusal", "message": exc.message, "fields": {}}},
                    status=status.HTTP_502_BAD_GATEWAY)


class RotationRefused(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT


class RegisterAgain(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "This node has no catalog GPU type yet; register again."


@extend_schema(exclude=True)
class Enrol(APIView):
    authentication_classes = []
    permission_classes = [AllowAny]
    throttle_classes = [EnrolThrottle]

    def post(self, request: Request) -> Response:
        """Exchange a join token for this node's credential (shown once); registers the node."""
        data = validated(serializers.EnrolInput, request,
                         context={"caller_is_local": caller_is_local(request)})
        try:
            node, credential = do_enrol_node(**data)
        except EnrolmentRefused as exc:  # not HTTP authentication: the token is the body's
            raise exceptions.PermissionDenied(str(exc)) from exc
        return secret_response({"node": serializers.NodeOutput(node).data,
                                "credential": credential, "timings": selectors.node_timings()})


class NodeRateThrottle(SimpleRateThrottle):
    """Calls per node: a busy node makes a few a second (heartbeats, progress, samples); a
    node that makes many more is faulty or hostile, and must not slow the control plane."""

    scope = "node"
    rate = "1200/min"

    def get_cache_key(self, request: Request, view: APIView | None) -> str:
        principal = request.user
        assert isinstance(principal, NodePrincipal)  # authenticated before it is throttled
        return self.cache_format % {"scope": self.scope, "ident": principal.node.id}


@extend_schema(exclude=True)
class NodeView(APIView):
    """A view of the node channel: the caller is a node agent, acting for `self.node`."""

    authentication_classes = [NodeCredentialAuthentication]
    permission_classes = [IsNode]
    throttle_classes = [NodeRateThrottle]

    @property
    def node(self) -> Node:
        principal = self.request.user
        assert isinstance(principal, NodePrincipal)  # IsNode let nothing else in
        return principal.node

    def handle_exception(self, exc: Exception) -> Response:
        # What a node may not do, or not now, is a 403 that says why.
        if isinstance(exc, replicas.MoveRefused | NotNow):
            exc = exceptions.PermissionDenied(str(exc))
        elif isinstance(exc, NodeRevoked):  # revoked since this request was authenticated
            exc = exceptions.AuthenticationFailed(str(exc))
        return super().handle_exception(exc)


class Register(NodeView):
    def post(self, request: Request) -> Response:
        """The agent starts (again): what it detected on its host."""
        data = validated(serializers.NodeReport, request,
                         context={"caller_is_local": caller_is_local(request)})
        node = do_register_node(name=self.node.name, **data)
        return Response({"node": serializers.NodeOutput(node).data,
                         "timings": selectors.node_timings()})


class Build(NodeView):
    def post(self, request: Request) -> Response:
        """The node's vLLM build, once its agent has read it."""
        data = validated(serializers.BuildInput, request)
        do_record_node_build(name=self.node.name, build=EngineBuild.of(data["version"], data))
        return Response(status=status.HTTP_204_NO_CONTENT)


class Heartbeat(NodeView):
    def post(self, request: Request) -> Response:
        """The agent is alive and runs these engines. The answer names those it must stop,
        and whether to rotate its credential; a 409 asks it to register again (the node has
        no catalog GPU type yet)."""
        data = validated(serializers.HeartbeatInput, request)
        unexpected = do_record_node_heartbeat(name=self.node.name,
                                              engines={str(rid) for rid in data["engines"]})
        if unexpected is None and Node.objects.filter(id=self.node.id,
                                                      state=NodeState.REVOKED).exists():
            raise NodeRevoked("This node was revoked since the call began.")
        if unexpected is None:
            raise RegisterAgain
        return Response({"stop": sorted(unexpected),
                         "rotate": selectors.rotation_asked(node=self.node)})


class Credential(NodeView):
    def post(self, request: Request) -> Response:
        """A new credential for this node; the one used here stays valid until the new one
        is first used."""
        try:
            secret = do_rotate_node_credential(node=self.node)
        except TooManyWaiting as exc:
            raise RotationRefused(str(exc)) from exc
        return secret_response({"credential": secret})


class ModelCache(NodeView):
    def post(self, request: Request) -> Response:
        """What the node's model cache holds now."""
        data = validated(serializers.ModelCacheInput, request)
        do_record_model_cache(name=self.node.name, entries=[
            {**entry, "last_used": entry["last_used"].isoformat()} for entry in data["entries"]])
        return Response(status=status.HTTP_204_NO_CONTENT)


class Replicas(NodeView):
    def get(self, request: Request) -> Response:
        """The node's replicas that have, or may have, an engine there."""
        return Response({"replicas": selectors.node_replicas(node=self.node)})


class ReplicaView(NodeView):
    """A view of one of the calling node's replicas, `self.replica`; any other id is a 404."""

    replica: Replica

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # authenticated and permitted first
        found = selectors.node_replica(node=self.node, replica_id=kwargs["replica_id"])
        if found is None:
            raise exceptions.NotFound("This node has no such replica.")
        self.replica = found


class ReplicaSpec(ReplicaView):
    def get(self, request: Request, replica_id: UUID) -> Response:
        """What starting the replica's engine needs, its key included."""
        return Response(selectors.replica_spec(replica=self.replica))


class Move(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """Move the replica a step of its engine's start or stop; `moved` is false when it
        had moved on."""
        data = validated(serializers.MoveInput, request)
        return Response({"moved": replicas.do_report_replica_move(
            node=self.node, replica_id=replica_id, **data)})


class Failure(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """The replica's engine failed; `moved` is false when the replica had moved on."""
        data = validated(serializers.FailureInput, request)
        return Response({"moved": replicas.do_report_replica_failure(
            node=self.node, replica_id=replica_id, **data)})


class Progress(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """How far the replica's step is; `current` false tells the agent to give it up."""
        data = validated(serializers.ProgressInput, request)
        return Response({"current": replicas.do_report_replica_progress(
            node=self.node, replica_id=replica_id, **data)})


class Pid(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """The process id of the replica's engine, once spawned."""
        data = validated(serializers.PidInput, request)
        replicas.do_report_replica_pid(node=self.node, replica_id=replica_id, **data)
        return Response(status=status.HTTP_204_NO_CONTENT)


class Log(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """The last lines of the engine's log, while it loads and serves."""
        data = validated(serializers.LogInput, request)
        replicas.do_report_replica_log(node=self.node, replica_id=replica_id, **data)
        return Response(status=status.HTTP_204_NO_CONTENT)


class Event(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """An event for the replica's user, while its agent is at work on it."""
        data = validated(serializers.EventInput, request)
        replicas.do_report_replica_event(node=self.node, replica_id=replica_id, **data)
        return Response(status=status.HTTP_204_NO_CONTENT)


class Adapters(ReplicaView):
    def get(self, request: Request, replica_id: UUID) -> Response:
        """The adapters the replica's engine must serve."""
        return Response({"adapters": selectors.replica_adapters(replica=self.replica)})

    def post(self, request: Request, replica_id: UUID) -> Response:
        """The adapters the replica's engine serves now."""
        data = validated(serializers.ServedAdaptersInput, request)
        replicas.do_report_served_adapters(node=self.node, replica_id=replica_id, **data)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AdapterFile(ReplicaView):
    def get(self, request: Request, replica_id: UUID, adapter_id: int, path: str
            ) -> HttpResponse:
        """A file of an uploaded adapter the replica serves."""
        content = selectors.uploaded_adapter_file(replica=self.replica,
                                                  adapter_id=adapter_id, path=path)
        if content is None:
            raise exceptions.NotFound("The replica serves no uploaded adapter with that file.")
        return HttpResponse(content, content_type="application/octet-stream")


class HubToken(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """The hub token for fetching the replica's model, or (`adapter`) one adapter of its
        endpoint, while it fetches it; null for a public one."""
        data = validated(serializers.HubTokenInput, request)
        return Response({"token": selectors.hub_token_for(replica=self.replica,
                                                          adapter_id=data.get("adapter"))})


class Pin(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """Pin the replica's model to a commit (the first node to fetch it does); returns
        the model as the replica's spec shows it."""
        try:
            model = replicas.do_pin_replica_model(replica=self.replica)
        except HubRefusal as exc:
            return hub_refusal(exc)
        return Response(selectors.model_spec(model=model))


class Pull(NodeView):
    def post(self, request: Request, model_id: int) -> Response:
        """A pull of a model an operator asked of this node: the model, pinned, and its hub
        token. Taken once; a 404 when none was asked (or it was taken)."""
        try:
            pull = replicas.do_take_model_pull(node=self.node, model_id=model_id)
        except HubRefusal as exc:
            return hub_refusal(exc)
        if pull is None:
            raise exceptions.NotFound("No pull of that model was asked of this node.")
        model, token = pull
        return Response({"model": selectors.model_spec(model=model), "token": token})


class Samples(NodeView):
    def post(self, request: Request) -> Response:
        """Samples of the node's engines' /metrics; those of other replicas are dropped."""
        data = validated(serializers.SamplesInput, request)
        kept = replicas.do_report_engine_samples(node=self.node, samples=[
            (sample.pop("replica"), sample.pop("at"), EngineSnapshot(**sample))
            for sample in (dict(item) for item in data["samples"])])
        return Response({"kept": kept})


class Certificate(ReplicaView):
    def post(self, request: Request, replica_id: UUID) -> Response:
        """Sign a certificate for the replica's engine, while it is being started; with the
        authority's certificate, which gateways trust it by."""
        data = validated(serializers.CertificateInput, request)
        try:
            signed = certificates.do_sign_engine_certificate(
                replica=self.replica, request_pem=data["signing_request"])
        except certificates.SigningRefused as exc:
            raise exceptions.ValidationError({"signing_request": [str(exc)]}) from exc
        return Response({"certificate": signed,
                         "authority": certificates.authority_certificate_pem(),
                         "host_name": certificates.replica_host_name(
                             replica_id=replica_id, node_id=self.node.id)},
                        status=status.HTTP_201_CREATED)
