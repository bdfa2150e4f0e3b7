"""The operators' console for people, organisations and keys. No secret is ever shown:
keys and invites hold only digests, and the digest fields are left out here too."""

from typing import Any

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from accounts.models import APIKey, Invite, Membership, Organization, Role, User
from accounts.services import do_revoke_api_key


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "name", "is_active", "is_staff", "date_joined", "email_verified_at",
                    "last_login"]
    search_fields = ["email", "name"]
    list_filter = ["is_active", "is_staff", "is_superuser", "email_verified_at"]
    fieldsets = [
        (None, {"fields": ["email", "password", "name", "email_verified_at"]}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups",
                                    "user_permissions"]}),
        ("Dates", {"fields": ["last_login", "date_joined"]}),
    ]
    add_fieldsets = [(None, {"classes": ["wide"], "fields": ["email", "password1", "password2"]})]


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "max_concurrent_requests", "max_endpoints", "max_gpus",
                    "max_replicas", "created_at"]
    list_filter = ["created_at"]
    search_fields = ["name", "slug"]
    fieldsets = [
        (None, {"fields": ["name", "slug", "created_at"]}),
        # Raised here when a customer asks; the services refuse past them with a 400.
        ("Limits and quotas (empty: the deployment's default)",
         {"fields": ["max_concurrent_requests", "max_endpoints", "max_gpus", "max_replicas"]}),
        ("Payment", {"fields": ["gpus_approved"]}),
    ]
    inlines = [MembershipInline]


@admin.register(APIKey)
class APIKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "masked", "organization", "scope", "purpose", "state", "created_at",
                    "expires_at", "last_used_at"]
    list_filter = ["scope", "purpose", "revoked_at"]
    search_fields = ["name", "prefix", "organization__name", "organization__slug"]
    list_select_related = ["organization"]
    fields = ["organization", "name", "scope", "purpose", "prefix", "last_four", "endpoint_names",
              "requests_per_minute", "tokens_per_minute", "created_by", "created_at",
              "expires_at", "revoked_at", "last_used_at"]
    # Operators may change a key's limits (gateways pick them up within the key-cache TTL).
    readonly_fields = [name for name in fields
                       if name not in ("requests_per_minute", "tokens_per_minute")]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Keys are created where the secret can be shown once: the dashboard or the API.
        return False

    # Revoked, never deleted one by one: the ledger's rows name their key, and usage still on
    # its way is billed to it. (An organisation deleted takes its keys with it, which the
    # delete permission, left as it is, allows.)
    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def delete_view(self, request: HttpRequest, object_id: str,
                    extra_context: dict | None = None) -> HttpResponse:
        raise PermissionDenied("API keys are revoked, never deleted.")

    def render_change_form(self, request: HttpRequest, context: dict, *args: Any,
                           **kwargs: Any) -> HttpResponse:
        context["show_delete"] = False
        return super().render_change_form(request, context, *args, **kwargs)

    @admin.action(description="Revoke the selected keys now", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[APIKey]) -> None:
        revoked = sum(do_revoke_api_key(key=key, actor_role=Role.OWNER) for key in queryset)
        self.message_user(request, f"Revoked {revoked} key(s).", messages.SUCCESS)


@admin.register(Invite)
class InviteAdmin(admin.ModelAdmin):
    list_display = ["organization", "email", "role", "state", "created_at", "expires_at"]
    list_filter = ["role", "created_at"]
    search_fields = ["email", "organization__name", "organization__slug"]
    list_select_related = ["organization"]
    fields = ["organization", "email", "role", "created_by", "created_at", "expires_at",
              "accepted_at", "accepted_by", "revoked_at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
