from rest_framework import serializers

from endpoints.models import GPUType, ModelSpec


class ModelSpecSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelSpec
        exclude = ["id"]


class GPUTypeSerializer(serializers.ModelSerializer):
    memory_gib = serializers.SerializerMethodField()

    class Meta:
        model = GPUType
        exclude = ["id", "device_match"]

    def get_memory_gib(self, gpu: GPUType) -> float:
        return round(gpu.memory_bytes / 2**30, 1)
