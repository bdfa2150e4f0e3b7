from rest_framework import serializers

from accounts.models import (
    LARGEST_LIMIT,
    APIKey,
    Invite,
    Membership,
    Organization,
    Role,
    Scope,
    User,
)
from kvrun.common.api import StrictSerializer


class UserSerializer(serializers.ModelSerializer):
    class Meta:
        model = User
        fields = ["id", "email", "name", "date_joined"]


class OrganizationSerializer(serializers.ModelSerializer):
    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "max_concurrent_requests", "created_at"]
        read_only_fields = ["max_concurrent_requests"]


class CallingKeySerializer(serializers.Serializer):
    id = serializers.UUIDField()
    scope = serializers.CharField()


class KeyCallerSerializer(serializers.Serializer):
    """Who is calling, when it is an API key: the key and its organisation."""

    api_key = CallingKeySerializer()
    organization = OrganizationSerializer()


class MembershipSerializer(serializers.ModelSerializer):
    user = UserSerializer(read_only=True)

    class Meta:
        model = Membership
        fields = ["user", "role", "created_at"]


class InviteSerializer(serializers.ModelSerializer):
    state = serializers.CharField(read_only=True)

    class Meta:
        model = Invite
        fields = ["id", "email", "role", "state", "created_at", "expires_at", "accepted_at"]


class CreatedInviteSerializer(InviteSerializer):
    token = serializers.CharField(read_only=True, help_text="Shown once; not stored.")
    url = serializers.CharField(read_only=True, help_text="The link to send; shown once.")

    class Meta(InviteSerializer.Meta):
        fields = [*InviteSerializer.Meta.fields, "token", "url"]


class APIKeySerializer(serializers.ModelSerializer):
    state = serializers.CharField(read_only=True)
    created_by = serializers.EmailField(source="created_by.email", read_only=True, default=None,
                                        allow_null=True)

    class Meta:
        model = APIKey
        fields = [
            "id", "name", "scope", "prefix", "last_four", "state", "endpoint_names",
            "requests_per_minute", "tokens_per_minute", "created_by", "created_at", "expires_at",
            "revoked_at", "last_used_at",
        ]


class CreatedAPIKeySerializer(APIKeySerializer):
    secret = serializers.CharField(read_only=True, help_text="Shown once; not stored.")

    class Meta(APIKeySerializer.Meta):
        fields = [*APIKeySerializer.Meta.fields, "secret"]


class SignUpInput(StrictSerializer):
    email = serializers.CharField(max_length=254)
    password = serializers.CharField(max_length=128, write_only=True, trim_whitespace=False)
    name = serializers.CharField(max_length=150, required=False, allow_blank=True, default="")
    organization_name = serializers.CharField(
        max_length=100, required=False, allow_blank=True, default=""
    )


class SignUpOutput(serializers.Serializer):
    user = UserSerializer()
    organization = OrganizationSerializer()


# A name is trimmed, so it needs one character that is not white space (the schema says so).
SOME_TEXT = r"\S"


class OrganizationInput(StrictSerializer):
    name = serializers.RegexField(SOME_TEXT, max_length=100, error_messages={
        "invalid": "Give the organisation a name, not only spaces."})


class MemberRoleInput(StrictSerializer):
    role = serializers.ChoiceField(choices=Role.choices)


class InviteInput(StrictSerializer):
    email = serializers.EmailField(
        required=False, allow_blank=True,
        help_text="Only a user signed in with this address can accept; empty: anyone with the "
                  "link.")
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)


class AcceptInviteInput(StrictSerializer):
    token = serializers.CharField(max_length=200)


class APIKeyInput(StrictSerializer):
    name = serializers.RegexField(SOME_TEXT, max_length=100, error_messages={
        "invalid": "Give the key a name, not only spaces."})
    scope = serializers.ChoiceField(choices=Scope.choices, default=Scope.INFERENCE)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)
    endpoint_names = serializers.ListField(
        child=serializers.RegexField(
            r"^[A-Za-z0-9_-]+(:[A-Za-z0-9_-]+)?\Z", max_length=127,
            error_messages={"invalid": "Name an endpoint, or one adapter of an endpoint as "
                                       "endpoint:adapter."}),
        required=False, default=list, max_length=100,
        help_text="Restrict the key to these endpoints (and their adapters), or to single "
                  "adapters as endpoint:adapter; empty means every endpoint.",
    )
    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=1, max_value=LARGEST_LIMIT,
        help_text="Inference requests per minute; omit for the deployment's default.")
    tokens_per_minute = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=1, max_value=LARGEST_LIMIT,
        help_text="Prompt plus completion tokens per minute; omit for the default.")
