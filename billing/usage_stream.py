"""The Redis stream that carries usage records from gateways to the ingester.

Gateways append one entry per finished request; the ingester reads them through a consumer
group and acknowledges an entry only after its row is committed in PostgreSQL, so a worker
that dies mid-batch leaves the entries pending for the next run.
"""

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import orjson

from billing.models import UsageRecord

STREAM = "kvrun:usage"
GROUP = "ingest"
DEAD_LETTERS = "kvrun:usage:dead"
FIELD = b"r"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def encode(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record)


def decode(payload: bytes) -> UsageRecord:
    """A row from what a gateway appended (see endpoints.gateway.app for the fields)."""
    data = orjson.loads(payload)
    return UsageRecord(
        request_id=data["request_id"],
        idempotency_key=data.get("idempotency_key") or "",
        organization_id=data["organization_id"],
        endpoint_id=data["endpoint_id"],
        replica_id=data.get("replica_id"),
        api_key_id=data.get("api_key_id"),
        operation=data["operation"],
        stream=data["stream"],
        prompt_tokens=data["prompt_tokens"],
        completion_tokens=data["completion_tokens"],
        cached_tokens=data["cached_tokens"],
        status_code=data["status_code"],
        error_code=data.get("error_code") or "",
        client_disconnected=data["client_disconnected"],
        started_at=EPOCH + timedelta(milliseconds=data["started_at_ms"]),
        time_to_first_token_ms=data.get("ttft_ms"),
        duration_ms=data["duration_ms"],
        gateway_overhead_ms=Decimal(str(data["overhead_ms"])),
    )
