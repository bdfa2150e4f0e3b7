"""One request through the gateway: what it asked, where it went, and what it consumed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from accounts.principals import KeyIdentity
from billing.usage_stream import UsageReport
from gateway.directory import Route, Upstream
from gateway.limits import Admission

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(slots=True)
class Exchange:
    request_id: str
    operation: str
    started_ms: int
    clock: float = field(default_factory=time.perf_counter)
    identity: KeyIdentity | None = None
    route: Route | None = None
    upstream: Upstream | None = None
    admission: Admission | None = None
    idempotency_key: str = ""
    stream: bool = False
    status: int = 200
    error_code: str = ""
    disconnected: bool = False
    usage_seen: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: int | None = None
    upstream_seconds: float = 0.0  # time spent waiting on the engine
    response: Any = None  # the engine's response while it is being read

    def take_usage(self, usage: dict[str, Any] | None) -> None:
        """Keep the engine's latest running (or final) usage figures."""
        if not usage:
            return
        self.usage_seen = True
        self.prompt_tokens = usage.get("prompt_tokens") or 0
        self.completion_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = details.get("cached_tokens") or 0

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.clock) * 1000

    def overhead_ms(self) -> float:
        """The gateway's own time: everything but waiting on the engine."""
        return max(0.0, self.elapsed_ms() - self.upstream_seconds * 1000)

    def mark_first_token(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = round(self.elapsed_ms())

    def report(self) -> UsageReport:
        """The request's usage record, as the billing ledger stores it."""
        assert self.identity is not None and self.route is not None
        return UsageReport(
            request_id=self.request_id,
            idempotency_key=self.idempotency_key,
            organization_id=str(self.identity.organization_id),
            endpoint_id=self.route.endpoint_id,
            replica_id=self.upstream.replica_id if self.upstream else None,
            api_key_id=str(self.identity.id),
            operation=self.operation,
            stream=self.stream,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            status_code=self.status,
            error_code=self.error_code,
            client_disconnected=self.disconnected,
            started_at=EPOCH + timedelta(milliseconds=self.started_ms),
            time_to_first_token_ms=self.ttft_ms,
            duration_ms=round(self.elapsed_ms()),
            gateway_overhead_ms=Decimal(f"{self.overhead_ms():.3f}"),
        )
