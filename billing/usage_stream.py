"""The Redis stream that carries usage from gateways to the ingester, and what it carries.

Gateways append one UsageReport per finished request; the ingester reads them through a
consumer group and acknowledges an entry only after its row is committed in PostgreSQL, so a
worker that dies mid-batch leaves the entries pending for the next run.

A request is traced from its admission until its report is on the stream: ADMITTED holds,
by request id, the report as it would read were its gateway to die now (renewed every few
seconds with the usage so far), and ADMITTED_SEEN when its gateway last vouched for it. A
trace not renewed for a lease (lease_ms) belongs to a gateway that died (a SIGKILL leaves no other
sign): the ingester stores it as an interrupted request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import orjson
from django.conf import settings

from billing.models import UsageRecord

STREAM = "kvrun:usage"
GROUP = "ingest"
DEAD_LETTERS = "kvrun:usage:dead"
FIELD = b"r"
# Beside a dead letter: why it could not be stored.
ERROR_FIELD = b"error"
ADMITTED = "kvrun:usage:admitted"
ADMITTED_SEEN = "kvrun:usage:admitted:seen"
# The largest token count a usage record holds (a PositiveIntegerField).
MOST_TOKENS = 2**31 - 1
# The status and error code of a request whose gateway died under it.
INTERRUPTED_STATUS, INTERRUPTED_CODE = 502, "gateway_interrupted"


def lease_ms() -> int:
    """How long a trace, or an in-flight slot, lives without renewal."""
    return int(settings.KVRUN_GATEWAY_LEASE_SECONDS * 1000)


def renew_seconds() -> float:
    """How often a live gateway renews what it holds: often enough that no pause of a live
    process outlasts its lease."""
    return settings.KVRUN_GATEWAY_LEASE_SECONDS / 6


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageReport:
    """One finished request as a gateway reports it: a UsageRecord's fields, by their names.

    Encoded as one JSON object (times in RFC 3339, the overhead as a decimal string).
    """

    request_id: str
    idempotency_key: str
    organization_id: str
    endpoint_id: str
    replica_id: str | None
    api_key_id: str | None
    operation: str
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    status_code: int
    error_code: str
    client_disconnected: bool
    started_at: datetime
    time_to_first_token_ms: int | None
    duration_ms: int
    gateway_overhead_ms: Decimal
    adapter: str = ""  # the LoRA adapter it called; empty for the endpoint's model

    def encode(self) -> bytes:
        return orjson.dumps(self, default=str)

    @classmethod
    def decode(cls, payload: bytes) -> UsageReport:
        """The report in `payload`; ValueError, KeyError, TypeError or ArithmeticError (a bad
        decimal) when it is not one."""
        data = orjson.loads(payload)
        data["started_at"] = datetime.fromisoformat(data["started_at"])
        data["gateway_overhead_ms"] = Decimal(data["gateway_overhead_ms"])
        return cls(**data)

    def as_row(self) -> UsageRecord:
        return UsageRecord(**{field.name: getattr(self, field.name)
                              for field in dataclasses.fields(self)})
