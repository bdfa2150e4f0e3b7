from django.urls import path

from fleet import api

urlpatterns = [
    path("enrol", api.Enrol.as_view(), name="node-enrol"),
    path("register", api.Register.as_view(), name="node-register"),
    path("build", api.Build.as_view(), name="node-build"),
    path("heartbeat", api.Heartbeat.as_view(), name="node-heartbeat"),
    path("credential", api.Credential.as_view(), name="node-credential"),
]
