"""The node channel's bodies. Each is strict: a field it does not know is refused, and every
number is bounded by what its column holds and what a host can have."""

import ipaddress
import math
from datetime import timedelta
from typing import Any

from django.utils import timezone
from rest_framework import serializers

from endpoints.models import State
from engine.devices import Device, HostResources
from engine.metrics import LARGEST_COUNT
from kvrun.common.api import StrictSerializer

# The most of its engine's log a replica shows: what engine.supervisor.tail reads at most.
LOG_TAIL_MOST = 64 * 1024
BYTES_MOST = 2**53  # 8 PiB: past any host's memory or disk, within a bigint
LARGEST_INT = 2**31 - 1  # an integer column
# How far a sample's time may be from the control plane's own: a node's clock is not trusted.
SAMPLE_CLOCK_SKEW = timedelta(minutes=5)


class DeviceInput(StrictSerializer):
    index = serializers.IntegerField(min_value=0, max_value=1023)
    name = serializers.CharField(max_length=200)
    memory_bytes = serializers.IntegerField(min_value=0, max_value=BYTES_MOST)


class ResourcesInput(StrictSerializer):
    devices = serializers.ListField(child=DeviceInput(), max_length=64)
    cpu_count = serializers.IntegerField(min_value=1, max_value=65_536)
    memory_bytes = serializers.IntegerField(min_value=0, max_value=BYTES_MOST)
    disk_bytes = serializers.IntegerField(
        min_value=0, max_value=BYTES_MOST,
        help_text="The file system its KV tiers on disk and its model cache are on.")

    def to_internal_value(self, data: object) -> HostResources:
        checked = super().to_internal_value(data)
        indices = [device["index"] for device in checked["devices"]]
        if len(set(indices)) != len(indices):
            raise serializers.ValidationError({"devices": ["Each device's index is its own."]})
        return HostResources(devices=[Device(**device) for device in checked["devices"]],
                             cpu_count=checked["cpu_count"],
                             memory_bytes=checked["memory_bytes"],
                             disk_bytes=checked["disk_bytes"])


class NodeReport(StrictSerializer):
    """What an agent says of its host when it starts. Its address is where gateways will send
    tenants' requests: never a multicast, link-local, reserved or unspecified one, and a
    loopback one only from a node on the control plane's own host (its call came from
    loopback: development)."""

    resources = ResourcesInput()
    address = serializers.IPAddressField(help_text="Where its engines listen for gateways.")
    model_cache_bytes = serializers.IntegerField(min_value=0, max_value=BYTES_MOST)

    def validate_address(self, value: str) -> str:
        address = ipaddress.ip_address(value)
        if (address.is_multicast or address.is_link_local or address.is_reserved
                or address.is_unspecified):
            raise serializers.ValidationError(
                "An address gateways can reach the node's engines at: not a multicast, "
                "link-local, reserved or unspecified one.")
        if address.is_loopback and not self.context.get("caller_is_local"):
            raise serializers.ValidationError(
                "A loopback address is only for a node on the control plane's own host; give "
                "the node's private address.")
        return value


class EnrolInput(NodeReport):
    join_token = serializers.CharField(max_length=200)
    name = serializers.CharField(max_length=100, help_text="The node's name, as its agent "
                                 "was given it; the join token must be for it.")


class BuildInput(StrictSerializer):
    version = serializers.CharField(max_length=40, allow_blank=True)
    architectures = serializers.ListField(child=serializers.CharField(max_length=100),
                                          max_length=2000)
    # Agents older than the parsers' report send none.
    tool_parsers = serializers.ListField(child=serializers.CharField(max_length=40),
                                         max_length=500, default=list)
    reasoning_parsers = serializers.ListField(child=serializers.CharField(max_length=40),
                                              max_length=500, default=list)


class HeartbeatInput(StrictSerializer):
    engines = serializers.ListField(child=serializers.UUIDField(format="hex_verbose"),
                                    max_length=10_000,
                                    help_text="The replicas whose engines run on the node now.")


class NodeOutput(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    gpu_type = serializers.CharField(source="gpu_type.slug", default=None)


class ModelCacheInput(StrictSerializer):
    class Entry(StrictSerializer):
        repo_id = serializers.CharField(max_length=200)
        commit = serializers.RegexField(r"[0-9a-f]{40}")
        bytes = serializers.IntegerField(min_value=0)
        last_used = serializers.DateTimeField()

    entries = serializers.ListField(child=Entry(), max_length=10_000)


STATES = [choice for choice, _ in State.choices]


class MoveInput(StrictSerializer):
    from_states = serializers.ListField(child=serializers.ChoiceField(STATES), min_length=1,
                                        max_length=len(STATES))
    to_state = serializers.ChoiceField(STATES)
    message = serializers.CharField(max_length=2000, allow_blank=True)
    port = serializers.IntegerField(min_value=1, max_value=65535, required=False)
    policy_version = serializers.IntegerField(min_value=0, max_value=LARGEST_INT,
                                              required=False)
    tool_call_parser = serializers.CharField(max_length=40, allow_blank=True, required=False)
    reasoning_parser = serializers.CharField(max_length=40, allow_blank=True, required=False)
    kv_cache_tokens = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT,
                                               required=False, allow_null=True)
    log_tail = serializers.CharField(max_length=LOG_TAIL_MOST, allow_blank=True, required=False,
                                     trim_whitespace=False)


class FailureInput(StrictSerializer):
    from_states = serializers.ListField(child=serializers.ChoiceField(STATES), min_length=1,
                                        max_length=len(STATES))
    reason = serializers.CharField(max_length=2000)
    log_tail = serializers.CharField(max_length=LOG_TAIL_MOST, allow_blank=True,
                                     trim_whitespace=False)


class ProgressInput(StrictSerializer):
    state = serializers.ChoiceField(STATES)
    stage = serializers.CharField(max_length=80)
    percent = serializers.IntegerField(min_value=0, max_value=100)
    download_done_at = serializers.DateTimeField(required=False, allow_null=True)


class PidInput(StrictSerializer):
    pid = serializers.IntegerField(min_value=1, max_value=2**31 - 1)


class LogInput(StrictSerializer):
    log_tail = serializers.CharField(max_length=LOG_TAIL_MOST, allow_blank=True,
                                     trim_whitespace=False)


class EventInput(StrictSerializer):
    message = serializers.CharField(max_length=500)


class ServedAdaptersInput(StrictSerializer):
    names = serializers.ListField(child=serializers.CharField(max_length=63), max_length=1000)


class Buckets(serializers.DictField):
    """A histogram's cumulative counts by upper bound ("0.5", "+Inf"), as vLLM reports them."""

    def __init__(self) -> None:
        super().__init__(child=serializers.FloatField(min_value=0, max_value=LARGEST_COUNT))

    def to_internal_value(self, data: Any) -> dict[str, float]:
        if isinstance(data, dict) and len(data) > 100:
            raise serializers.ValidationError("At most 100 buckets.")
        buckets = super().to_internal_value(data)
        for bound in buckets:
            if not _is_bound(bound):
                raise serializers.ValidationError(
                    "Each bucket's bound is a number, or +Inf, of at most 32 characters.")
        return buckets


class SampleInput(StrictSerializer):
    replica = serializers.UUIDField()
    at = serializers.DateTimeField()
    kv_cache_usage = serializers.FloatField(min_value=0, max_value=1)
    running = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    waiting = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    prefix_queries = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    prefix_hits = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    external_queries = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT,
                                                allow_null=True)
    external_hits = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT,
                                             allow_null=True)
    preemptions = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    prompt_tokens = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    generation_tokens = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    requests = serializers.IntegerField(min_value=0, max_value=LARGEST_COUNT)
    ttft_buckets = Buckets()
    itl_buckets = Buckets()
    prompt_buckets = Buckets()
    max_tokens_buckets = Buckets()

    def validate_at(self, value: Any) -> Any:
        if abs(value - timezone.now()) > SAMPLE_CLOCK_SKEW:
            raise serializers.ValidationError(
                "A sample is taken now: this time is more than five minutes from the control "
                "plane's clock (is the node's clock set?).")
        return value

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["prefix_hits"] > data["prefix_queries"]:
            raise serializers.ValidationError("prefix_hits cannot exceed prefix_queries.")
        return data


def _is_bound(text: str) -> bool:
    if text == "+Inf":
        return True
    try:
        return len(text) <= 32 and math.isfinite(float(text))
    except ValueError:
        return False


class SamplesInput(StrictSerializer):
    samples = serializers.ListField(child=SampleInput(), max_length=1000)


class HubTokenInput(StrictSerializer):
    adapter = serializers.IntegerField(min_value=1, max_value=2**63 - 1, required=False,
                                       help_text="One of the endpoint's adapters; without it, "
                                                 "the replica's model.")


class CertificateInput(StrictSerializer):
    signing_request = serializers.CharField(max_length=16_384, trim_whitespace=False,
                                            help_text="A PEM certificate signing request.")
