"""The node channel's bodies. Each is strict: a field it does not know is refused."""

from rest_framework import serializers

from engine.devices import Device, HostResources
from kvrun.common.api import StrictSerializer


class DeviceInput(StrictSerializer):
    index = serializers.IntegerField(min_value=0)
    name = serializers.CharField(max_length=200)
    memory_bytes = serializers.IntegerField(min_value=0)


class ResourcesInput(StrictSerializer):
    devices = serializers.ListField(child=DeviceInput(), max_length=64)
    cpu_count = serializers.IntegerField(min_value=1)
    memory_bytes = serializers.IntegerField(min_value=0)

    def to_internal_value(self, data: object) -> HostResources:
        checked = super().to_internal_value(data)
        return HostResources(devices=[Device(**device) for device in checked["devices"]],
                             cpu_count=checked["cpu_count"],
                             memory_bytes=checked["memory_bytes"])


class NodeReport(StrictSerializer):
    """What an agent says of its host when it starts."""

    resources = ResourcesInput()
    address = serializers.IPAddressField(help_text="Where its engines listen for gateways.")
    model_cache_bytes = serializers.IntegerField(min_value=0)


class EnrolInput(NodeReport):
    join_token = serializers.CharField(max_length=200)


class BuildInput(StrictSerializer):
    version = serializers.CharField(max_length=40, allow_blank=True)
    architectures = serializers.ListField(child=serializers.CharField(max_length=100),
                                          max_length=2000)


class HeartbeatInput(StrictSerializer):
    engines = serializers.ListField(child=serializers.UUIDField(format="hex_verbose"),
                                    max_length=10_000,
                                    help_text="The replicas whose engines run on the node now.")


class NodeOutput(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    gpu_type = serializers.CharField(source="gpu_type.slug", default=None)
