"""REST views for accounts. Thin: they parse input, call a service or selector, render."""


from django.db.models import QuerySet
from django_filters import rest_framework as filters
from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import api_view, permission_classes, throttle_classes
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from accounts import selectors, serializers, services
from accounts.models import APIKey, Invite, Membership, Organization, User
from accounts.permissions import SignedInUser
from accounts.principals import KeyPrincipal
from accounts.scoping import OrganizationScoped
from kvrun.common.api import AddressRateThrottle, BooleanFilter, secret_response, validated


def _creator(request: Request) -> User | None:
    return request.user if isinstance(request.user, User) else None


class SignUpThrottle(AddressRateThrottle):
    """Sign-ups per client address, through the API and the dashboard together."""

    scope = "signup"
    rate = "20/hour"


@extend_schema(request=serializers.SignUpInput, responses={201: serializers.SignUpOutput})
@api_view(["POST"])
@permission_classes([AllowAny])
@throttle_classes([SignUpThrottle])
def sign_up(request: Request) -> Response:
    """Create an account and an organisation that it owns."""
    data = validated(serializers.SignUpInput, request)
    user = services.do_sign_up(**data)
    organization = user.organizations.get()
    output = serializers.SignUpOutput({"user": user, "organization": organization})
    return Response(output.data, status=status.HTTP_201_CREATED)


@extend_schema(responses=PolymorphicProxySerializer(
    component_name="Caller", resource_type_field_name=None,
    serializers=[serializers.UserSerializer, serializers.KeyCallerSerializer]))
@api_view(["GET"])
def me(request: Request) -> Response:
    """The signed-in user, or for an API key the key and the organisation it belongs to."""
    if isinstance(request.user, KeyPrincipal):
        organization = Organization.objects.get(id=request.user.key.organization_id)
        return Response(serializers.KeyCallerSerializer(
            {"api_key": request.user.key, "organization": organization}).data)
    return Response(serializers.UserSerializer(request.user).data)


@extend_schema(request=serializers.AcceptInviteInput,
               responses={201: serializers.MembershipSerializer})
@api_view(["POST"])
@permission_classes([IsAuthenticated, SignedInUser])
def accept_invite(request: Request) -> Response:
    """Join an organisation with an invite token."""
    data = validated(serializers.AcceptInviteInput, request)
    membership = services.do_accept_invite(token=data["token"], user=request.user)
    return Response(
        serializers.MembershipSerializer(membership).data, status=status.HTTP_201_CREATED
    )


class OrganizationViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = serializers.OrganizationSerializer
    lookup_field = "slug"
    ordering_fields = ["name", "created_at"]
    ordering = ["name"]

    def get_queryset(self) -> QuerySet[Organization]:
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request to scope by
            return Organization.objects.none()
        return selectors.organizations_visible_to(principal=self.request.user)

    @extend_schema(request=serializers.OrganizationInput,
                   responses={201: serializers.OrganizationSerializer})
    def create(self, request: Request) -> Response:
        if isinstance(request.user, KeyPrincipal):
            self.permission_denied(request, message=SignedInUser.message)
        data = validated(serializers.OrganizationInput, request)
        organization = services.do_create_organization(user=request.user, name=data["name"])
        return Response(self.get_serializer(organization).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=serializers.OrganizationInput)
    def partial_update(self, request: Request, slug: str) -> Response:
        organization = self.get_object()
        role = selectors.role_of(principal=request.user, organization=organization)
        services.require_manager(role, "rename the organisation")
        data = validated(serializers.OrganizationInput, request, partial=True)
        if "name" in data:
            organization = services.do_rename_organization(organization=organization,
                                                           name=data["name"])
        return Response(self.get_serializer(organization).data)


class MemberFilter(filters.FilterSet):
    class Meta:
        model = Membership
        fields = ["role"]


class MemberViewSet(OrganizationScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                    viewsets.GenericViewSet):
    serializer_class = serializers.MembershipSerializer
    lookup_field = "user_id"
    filterset_class = MemberFilter
    ordering_fields = ["created_at", "role", "user__email"]
    ordering = ["created_at"]

    def get_queryset(self) -> QuerySet[Membership]:
        return selectors.memberships_of(organization=self.organization)

    @extend_schema(request=serializers.MemberRoleInput)
    def partial_update(self, request: Request, **kwargs: str) -> Response:
        membership = self.get_object()
        data = validated(serializers.MemberRoleInput, request)
        membership = services.do_change_member_role(
            membership=membership, role=data["role"], actor_role=self.actor_role
        )
        return Response(self.get_serializer(membership).data)

    def destroy(self, request: Request, **kwargs: str) -> Response:
        services.do_remove_member(
            membership=self.get_object(), actor_role=self.actor_role, actor=_creator(request)
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


class InviteViewSet(OrganizationScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                    viewsets.GenericViewSet):
    serializer_class = serializers.InviteSerializer
    ordering_fields = ["created_at", "expires_at"]
    ordering = ["-created_at"]

    def get_queryset(self) -> QuerySet[Invite]:
        return selectors.invites_of(organization=self.organization)

    @extend_schema(request=serializers.InviteInput,
                   responses={201: serializers.CreatedInviteSerializer})
    def create(self, request: Request, **kwargs: str) -> Response:
        data = validated(serializers.InviteInput, request)
        invite, token = services.do_create_invite(
            organization=self.organization, actor_role=self.actor_role,
            created_by=_creator(request), **data,
        )
        invite.token = token
        invite.url = services.invite_url(token)
        return secret_response(serializers.CreatedInviteSerializer(invite).data)

    def destroy(self, request: Request, **kwargs: str) -> Response:
        services.do_revoke_invite(invite=self.get_object(), actor_role=self.actor_role)
        return Response(status=status.HTTP_204_NO_CONTENT)


class APIKeyFilter(filters.FilterSet):
    revoked = BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = APIKey
        fields = ["scope", "revoked"]


class APIKeyViewSet(OrganizationScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                    viewsets.GenericViewSet):
    serializer_class = serializers.APIKeySerializer
    filterset_class = APIKeyFilter
    ordering_fields = ["created_at", "name", "last_used_at"]
    ordering = ["-created_at"]

    def get_queryset(self) -> QuerySet[APIKey]:
        return selectors.api_keys_of(organization=self.organization)

    @extend_schema(request=serializers.APIKeyInput,
                   responses={201: serializers.CreatedAPIKeySerializer})
    def create(self, request: Request, **kwargs: str) -> Response:
        data = validated(serializers.APIKeyInput, request)
        key, secret = services.do_create_api_key(
            organization=self.organization, actor_role=self.actor_role,
            created_by=_creator(request), **data,
        )
        key.secret = secret
        return secret_response(serializers.CreatedAPIKeySerializer(key).data)

    def destroy(self, request: Request, **kwargs: str) -> Response:
        """Revoke the key at once; the row stays for the audit trail."""
        services.do_revoke_api_key(key=self.get_object(), actor_role=self.actor_role)
        return Response(status=status.HTTP_204_NO_CONTENT)
