from django.urls import path

from fleet import api, feed

REPLICA = "replicas/<uuid:replica_id>"

urlpatterns = [
    path("enrol", api.Enrol.as_view(), name="node-enrol"),
    path("register", api.Register.as_view(), name="node-register"),
    path("build", api.Build.as_view(), name="node-build"),
    path("heartbeat", api.Heartbeat.as_view(), name="node-heartbeat"),
    path("credential", api.Credential.as_view(), name="node-credential"),
    path("model-cache", api.ModelCache.as_view(), name="node-model-cache"),
    path("samples", api.Samples.as_view(), name="node-samples"),
    path("work", feed.work, name="node-work"),
    path("replicas", api.Replicas.as_view(), name="node-replicas"),
    path("pulls/<int:model_id>", api.Pull.as_view(), name="node-pull"),
    path(REPLICA, api.ReplicaSpec.as_view(), name="node-replica"),
    path(f"{REPLICA}/move", api.Move.as_view(), name="node-replica-move"),
    path(f"{REPLICA}/failure", api.Failure.as_view(), name="node-replica-failure"),
    path(f"{REPLICA}/progress", api.Progress.as_view(), name="node-replica-progress"),
    path(f"{REPLICA}/pid", api.Pid.as_view(), name="node-replica-pid"),
    path(f"{REPLICA}/log", api.Log.as_view(), name="node-replica-log"),
    path(f"{REPLICA}/events", api.Event.as_view(), name="node-replica-events"),
    path(f"{REPLICA}/adapters", api.Adapters.as_view(), name="node-replica-adapters"),
    path(f"{REPLICA}/adapters/<int:adapter_id>/files/<path:path>", api.AdapterFile.as_view(),
         name="node-replica-adapter-file"),
    path(f"{REPLICA}/hub-token", api.HubToken.as_view(), name="node-replica-hub-token"),
    path(f"{REPLICA}/certificate", api.Certificate.as_view(), name="node-replica-certificate"),
    path(f"{REPLICA}/pin", api.Pin.as_view(), name="node-replica-pin"),
]
