"""What a person sets for an endpoint, as values the services take: its KV policy (what its
engines start with, and how the gateway routes to them) and how it scales.

Defaults are a new endpoint's (endpoints.models names its bounds and defaults); the services
judge the values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from endpoints.models import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_IDLE_SECONDS,
    DEFAULT_LORA_RANK,
    DEFAULT_SCALE_DOWN_WINDOW_SECONDS,
    DEFAULT_SCALE_UP_WINDOW_SECONDS,
    CacheIsolation,
    Endpoint,
    KVCacheDtype,
    ScalingMetric,
)


class _Settings:
    """What the two kinds of settings share: read from an endpoint, and from a form's or a
    request's values, which may hold other fields besides."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def of(cls, endpoint: Endpoint) -> Self:
        return cls(**{name: getattr(endpoint, name) for name in cls.field_names()})

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Self:
        """The settings `values` holds, the defaults for the rest (a value of None, as a form
        leaves an empty optional field, is a default too)."""
        return cls(**{name: values[name] for name in cls.field_names()
                      if values.get(name) is not None})

    def changed(self, changes: Mapping[str, Any]) -> Self:
        """These settings with `changes` made; a name that is not a setting raises TypeError."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def as_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True, kw_only=True)
class EndpointPolicy(_Settings):
    """An endpoint's KV policy: the context and concurrency its KV cache is sized for, the
    cache's dtype, prefix caching and tiers, which its engines start with (a change replaces
    the replicas), and whose prefixes are shared and where requests go, which the gateway
    applies (no restart); and the LoRA adapters its engines can hold."""

    ENGINE_FIELDS: ClassVar = ("context_length", "concurrency", "kv_cache_dtype",
                               "prefix_caching", "host_tier_gib", "disk_tier_gib",
                               "lora_adapters", "lora_max_rank", "lora_host_adapters")

    context_length: int = DEFAULT_CONTEXT_LENGTH
    concurrency: int = DEFAULT_CONCURRENCY
    kv_cache_dtype: str = KVCacheDtype.AUTO
    prefix_caching: bool = True
    host_tier_gib: int = 0
    disk_tier_gib: int = 0
    cache_isolation: str = CacheIsolation.ORGANIZATION
    prefix_affinity: bool = True
    lora_adapters: int = 0
    lora_max_rank: int = DEFAULT_LORA_RANK
    lora_host_adapters: int = 0


@dataclass(frozen=True, kw_only=True)
class EndpointScaling(_Settings):
    """How an endpoint scales: its range of replicas, the idle time before it scales to zero
    (with a fewest of 0), and the autoscaler's metric, target (None: the metric's default)
    and windows."""

    min_replicas: int = 1
    max_replicas: int = 1
    scale_to_zero_after_seconds: int = DEFAULT_IDLE_SECONDS
    scaling_metric: str = ScalingMetric.IN_FLIGHT
    scaling_target: float | None = None
    scale_up_window_seconds: int = DEFAULT_SCALE_UP_WINDOW_SECONDS
    scale_down_window_seconds: int = DEFAULT_SCALE_DOWN_WINDOW_SECONDS

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Self:
        """As for _Settings, where a most replicas not said is the fewest, or 1 for a fewest
        of 0; and a target of None is a choice (the metric's default), not a value left
        out."""
        scaling = super().from_values(values)
        return scaling.changed({
            "max_replicas": (values["max_replicas"] if values.get("max_replicas") is not None
                             else max(1, scaling.min_replicas)),
            "scaling_target": values.get("scaling_target")})
