from django.urls import path

from front import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("orgs/<slug:org_slug>/", views.dashboard, name="dashboard-org"),
    path("orgs/<slug:org_slug>/keys/", views.create_api_key, name="dashboard-key-create"),
    path("orgs/<slug:org_slug>/keys/<uuid:key_id>/revoke/", views.revoke_api_key,
         name="dashboard-key-revoke"),
    path("orgs/<slug:org_slug>/invites/", views.create_invite, name="dashboard-invite-create"),
    path("orgs/<slug:org_slug>/members/<int:user_id>/remove/", views.remove_member,
         name="dashboard-member-remove"),
]
