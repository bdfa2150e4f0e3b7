from django.urls import path

from accounts import api

ORG = "organizations/<slug:org_slug>"

urlpatterns = [
    path("signup/", api.sign_up, name="api-signup"),
    path("me/", api.me, name="api-me"),
    path("invites/accept/", api.accept_invite, name="api-invite-accept"),
    path(
        "organizations/",
        api.OrganizationViewSet.as_view({"get": "list", "post": "create"}),
        name="api-organizations",
    ),
    path(
        "organizations/<slug:slug>/",
        api.OrganizationViewSet.as_view({"get": "retrieve", "patch": "partial_update"}),
        name="api-organization",
    ),
    path(f"{ORG}/members/", api.MemberViewSet.as_view({"get": "list"}), name="api-members"),
    path(
        f"{ORG}/members/<int:user_id>/",
        api.MemberViewSet.as_view(
            {"get": "retrieve", "patch": "partial_update", "delete": "destroy"}
        ),
        name="api-member",
    ),
    path(
        f"{ORG}/invites/",
        api.InviteViewSet.as_view({"get": "list", "post": "create"}),
        name="api-invites",
    ),
    path(
        f"{ORG}/invites/<uuid:pk>/",
        api.InviteViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="api-invite",
    ),
    path(
        f"{ORG}/api-keys/",
        api.APIKeyViewSet.as_view({"get": "list", "post": "create"}),
        name="api-keys",
    ),
    path(
        f"{ORG}/api-keys/<uuid:pk>/",
        api.APIKeyViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="api-key",
    ),
]
