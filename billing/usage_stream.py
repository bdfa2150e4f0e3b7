"""The Redis stream that carries usage from gateways to the ingester, and what it carries.

Gateways append one UsageReport per finished request; the ingester reads them through a
consumer group and acknowledges an entry only after its row is committed in PostgreSQL, so a
worker that dies mid-batch leaves the entries pending for the next run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import orjson

from billing.models import UsageRecord

STREAM = "kvrun:usage"
GROUP = "ingest"
DEAD_LETTERS = "kvrun:usage:dead"
FIELD = b"r"
# Beside a dead letter: why it could not be stored.
ERROR_FIELD = b"error"


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
