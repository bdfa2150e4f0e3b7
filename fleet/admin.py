"""The console's join tokens and node credentials. A join token is made here (its secret is
shown once); a node is revoked from its credentials' list."""

from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from accounts.models import User
from endpoints.admin import ReadOnlyAdmin
from fleet.enrolment import (
    JOIN_TOKEN_LIFETIME,
    JOIN_TOKEN_LONGEST_LIFETIME,
    do_ask_rotation,
    do_create_join_token,
    do_revoke_node,
    owner_refusal,
)
from fleet.forms import NodeTokenFields, as_sentence
from fleet.models import JoinToken, NodeCredential


class JoinTokenForm(NodeTokenFields, forms.ModelForm):
    minutes = forms.IntegerField(
        min_value=1, max_value=int(JOIN_TOKEN_LONGEST_LIFETIME.total_seconds() // 60),
        initial=int(JOIN_TOKEN_LIFETIME.total_seconds() // 60),
        help_text="How long the token may be used; once used, it is spent.")
    class Meta:
        model = JoinToken
        fields = ["node_name", "region", "organization"]
        help_texts = {"region": "Where the node is: endpoints that require a region run on "
                                "its nodes alone. The node cannot change it.",
                      "organization": "Whose own node it is: only that organisation's "
                                      "endpoints run there. Empty: a shared node."}

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if cleaned.get("node_name") and (refusal := owner_refusal(
                node_name=cleaned["node_name"], organization=cleaned.get("organization"))):
            self.add_error("node_name", as_sentence(refusal))
        return cleaned


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    list_display = ["node_name", "region", "zone", "organization", "created_at", "expires_at",
                    "used_at", "created_by"]
    search_fields = ["node_name"]
    form = JoinTokenForm
    fields = ["node_name", "region", "zone", "organization", "minutes"]

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: JoinToken, form: Any, change: bool) -> None:
        token, secret = do_create_join_token(
            node_name=form.cleaned_data["node_name"],
            valid_for=timedelta(minutes=form.cleaned_data["minutes"]),
            region=form.cleaned_data["region"], zone=form.cleaned_data["zone"] or "",
            organization=form.cleaned_data["organization"],
            created_by=request.user if isinstance(request.user, User) else None)
        obj.pk = token.pk
        self.message_user(request, (
            f"Join token for node {token.node_name} (shown once, valid until "
            f"{token.expires_at:%Y-%m-%d %H:%M} UTC): {secret}. The node's agent exchanges it "
            "for a credential of its own at /node/v1/enrol."), messages.WARNING)


@admin.register(NodeCredential)
class NodeCredentialAdmin(ReadOnlyAdmin):
    # Revoked before rotation asked: the list is cut at the right beside the filters.
    list_display = ["node", "created_at", "first_used_at", "last_used_at", "revoked_at",
                    "rotation_asked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["node__name"]
    list_select_related = ["node"]
    actions = ["rotate_credentials", "revoke_nodes"]

    @admin.action(description="Rotate: each node's agent takes a new credential at its next "
                              "heartbeat", permissions=["change"])
    def rotate_credentials(self, request: HttpRequest,
                           queryset: QuerySet[NodeCredential]) -> None:
        node_ids = set(queryset.values_list("node_id", flat=True))
        marked = do_ask_rotation(node_ids=node_ids)
        self.message_user(request, f"Asked {len(node_ids)} node(s) to rotate {marked} live "
                                   "credential(s): each agent does at its next heartbeat, and "
                                   "the old credential is refused once the new one is used.",
                          messages.SUCCESS)

    @admin.action(description="Revoke their nodes: refuse the agents, move their replicas",
                  permissions=["change"])
    def revoke_nodes(self, request: HttpRequest, queryset: QuerySet[NodeCredential]) -> None:
        node_ids = set(queryset.values_list("node_id", flat=True))
        moved = sum(do_revoke_node(node_id=node_id) for node_id in node_ids)
        self.message_user(request, f"Revoked {len(node_ids)} node(s); {moved} replica(s) are "
                                   "moving to other nodes.", messages.SUCCESS)
