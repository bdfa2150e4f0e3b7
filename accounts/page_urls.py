from django.conf import settings
from django.contrib.auth import views as auth_views
from django.urls import path

from accounts import views

urlpatterns = [
    path("signup/", views.sign_up, name="signup"),
    path("login/", auth_views.LoginView.as_view(template_name="accounts/login.html"),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("password/", auth_views.PasswordChangeView.as_view(
        template_name="accounts/password_change.html", success_url="/password/done/"),
        name="password_change"),
    path("password/done/", auth_views.PasswordChangeDoneView.as_view(
        template_name="accounts/password_changed.html"), name="password_change_done"),
    path("password/reset/", views.PasswordResetView.as_view(), name="password_reset"),
    path("password/reset/sent/", auth_views.PasswordResetDoneView.as_view(
        template_name="accounts/password_reset_sent.html",
        extra_context={"timeout_days": settings.PASSWORD_RESET_TIMEOUT // 86400}),
        name="password_reset_done"),
    path("password/reset/<uidb64>/<token>/", auth_views.PasswordResetConfirmView.as_view(
        template_name="accounts/password_reset_confirm.html",
        success_url="/password/reset/done/"), name="password_reset_confirm"),
    path("password/reset/done/", auth_views.PasswordResetCompleteView.as_view(
        template_name="accounts/password_reset_done.html"), name="password_reset_complete"),
    path("email/verify/", views.send_email_verification, name="send-email-verification"),
    path("email/verify/<str:token>/", views.verify_email, name="verify-email"),
    path("invite/<str:token>/", views.accept_invite, name="invite-accept"),
]
