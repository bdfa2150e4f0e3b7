from django.contrib.auth import views as auth_views
from django.urls import path

from accounts import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("signup/", views.sign_up, name="signup"),
    path("login/", auth_views.LoginView.as_view(template_name="accounts/login.html"),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("password/", auth_views.PasswordChangeView.as_view(
        template_name="accounts/password_change.html", success_url="/password/done/"),
        name="password_change"),
    path("password/done/", auth_views.PasswordChangeDoneView.as_view(
        template_name="accounts/password_changed.html"), name="password_change_done"),
    path("invite/<str:token>/", views.accept_invite, name="invite-accept"),
    path("orgs/<slug:org_slug>/", views.dashboard, name="dashboard-org"),
    path("orgs/<slug:org_slug>/keys/", views.create_api_key, name="dashboard-key-create"),
    path("orgs/<slug:org_slug>/keys/<uuid:key_id>/revoke/", views.revoke_api_key,
         name="dashboard-key-revoke"),
    path("orgs/<slug:org_slug>/invites/", views.create_invite, name="dashboard-invite-create"),
    path("orgs/<slug:org_slug>/members/<int:user_id>/remove/", views.remove_member,
         name="dashboard-member-remove"),
]
