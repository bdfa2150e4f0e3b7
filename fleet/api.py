"""The node channel, /node/v1/: the only way a node agent reaches the control plane. Each view
acts for the calling node alone (fleet.authentication); a replica id of another node is a
404, as for an id that does not exist. Not part of the public API's schema."""

from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from endpoints.models import Node
from engine.build import EngineBuild
from fleet import serializers
from fleet.authentication import IsNode, NodeCredentialAuthentication, NodePrincipal
from fleet.enrolment import EnrolmentRefused, do_enrol_node, do_rotate_node_credential
from fleet.reports import (
    NodeRevoked,
    do_record_node_build,
    do_record_node_heartbeat,
    do_register_node,
)
from kvrun.common.api import AddressRateThrottle, validated


class EnrolThrottle(AddressRateThrottle):
    """Guesses at join tokens, per client address."""

    scope = "node-enrol"
    rate = "30/hour"


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
        data = validated(serializers.EnrolInput, request)
        try:
            node, credential = do_enrol_node(**data)
        except EnrolmentRefused as exc:  # not HTTP authentication: the token is the body's
            raise exceptions.PermissionDenied(str(exc)) from exc
        return Response({"node": serializers.NodeOutput(node).data, "credential": credential},
                        status=status.HTTP_201_CREATED)


@extend_schema(exclude=True)
class NodeView(APIView):
    """A view of the node channel: the caller is a node agent, acting for `self.node`."""

    authentication_classes = [NodeCredentialAuthentication]
    permission_classes = [IsNode]

    @property
    def node(self) -> Node:
        principal = self.request.user
        assert isinstance(principal, NodePrincipal)  # IsNode let nothing else in
        return principal.node


class Register(NodeView):
    def post(self, request: Request) -> Response:
        """The agent starts (again): what it detected on its host."""
        data = validated(serializers.NodeReport, request)
        try:
            node = do_register_node(name=self.node.name, **data)
        except NodeRevoked as exc:  # revoked since this request was authenticated
            raise exceptions.AuthenticationFailed(str(exc)) from exc
        return Response({"node": serializers.NodeOutput(node).data})


class Build(NodeView):
    def post(self, request: Request) -> Response:
        """The node's vLLM build, once its agent has read it."""
        data = validated(serializers.BuildInput, request)
        do_record_node_build(name=self.node.name, build=EngineBuild(
            version=data["version"], architectures=tuple(data["architectures"])))
        return Response(status=status.HTTP_204_NO_CONTENT)


class Heartbeat(NodeView):
    def post(self, request: Request) -> Response:
        """The agent is alive and runs these engines. The answer names those it must stop;
        a 409 asks it to register again (the node has no catalog GPU type yet)."""
        data = validated(serializers.HeartbeatInput, request)
        unexpected = do_record_node_heartbeat(name=self.node.name,
                                              engines={str(rid) for rid in data["engines"]})
        if unexpected is None:
            raise RegisterAgain
        return Response({"stop": sorted(unexpected)})


class Credential(NodeView):
    def post(self, request: Request) -> Response:
        """A new credential for this node; the one used here stays valid until the new one
        is first used."""
        return Response({"credential": do_rotate_node_credential(node=self.node)},
                        status=status.HTTP_201_CREATED)
