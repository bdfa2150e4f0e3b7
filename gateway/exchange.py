"""One request through the gateway: what it asked, where it went, and what it consumed."""

from __future__ import annotations

import logging
import reprlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from accounts.principals import KeyIdentity
from billing.usage_stream import INTERRUPTED_CODE, INTERRUPTED_STATUS, MOST_TOKENS, UsageReport
from gateway.directory import Route, Upstream
from gateway.idempotency import Claim
from gateway.limits import Admission

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Exchange:
    request_id: str
    operation: str
    started_ms: int
    # Under /v1/messages: Anthropic's API, in its shapes (gateway.messages).
    anthropic: bool = False
    clock: float = field(default_factory=time.perf_counter)
    identity: KeyIdentity | None = None
    route: Route | None = None
    upstream: Upstream | None = None
    admission: Admission | None = None
    idempotency_key: str = ""
    idempotency: Claim | None = None
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
    client_seconds: float = 0.0  # time spent waiting on the client to send or to read
    held_seconds: float = 0.0  # time spent waiting for a cold start (gateway.hold)
    response_started: bool = False  # its headers are sent: an error now goes in the stream
    estimated_prompt_tokens: int = 0  # until the engine says how many there are
    # The most tokens the engine can have read, and written, for it (its sequences at the
    # endpoint's context): what bounds the usage the engine reports.
    most_tokens: int = MOST_TOKENS
    doubted: bool = False  # an impossible figure of its engine's was logged
    response: Any = None  # the engine's response while it is being read
    # The tokens (prompt, completion, cached) of its trace as Redis last confirmed it.
    traced: tuple[int, int, int] = (0, 0, 0)

    def take_usage(self, usage: object) -> None:
        """Keep the engine's latest running (or final) usage figures, each made billable by
        `counted`, and never more cached tokens than prompt tokens."""
        if not usage or not isinstance(usage, dict):
            return
        self.usage_seen = True
        self.prompt_tokens = self.counted(usage.get("prompt_tokens"))
        self.completion_tokens = self.counted(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = self.counted(details.get("cached_tokens") if isinstance(details, dict) else 0)
        if cached > self.prompt_tokens:
            self._doubt(f"reported {cached} cached tokens of a {self.prompt_tokens}-token prompt")
        self.cached_tokens = min(cached, self.prompt_tokens)

    def counted(self, reported: object) -> int:
        """A token count as the engine reported it, as the ledger may hold it. An engine runs
        weights its tenant chose, so what it says is checked: anything but a whole number
        counts as none, and a count is never negative nor above `most_tokens`."""
        tokens = 0
        if isinstance(reported, int) and not isinstance(reported, bool):
            tokens = min(max(reported, 0), self.most_tokens)
        if reported is not None and tokens != reported:
            self._doubt(f"reported {reprlib.repr(reported)} tokens; {tokens} counted")
        return tokens

    def _doubt(self, what: str) -> None:
        """Log the first impossible figure of its engine: a lying engine's stream would
        otherwise write a warning a token."""
        if not self.doubted:
            self.doubted = True
            logger.warning("the engine of %s %s", self.request_id, what)

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.clock) * 1000

    def overhead_ms(self) -> float:
        """The gateway's own time: everything but waiting on the engine, the client or a
        cold start."""
        waited = self.upstream_seconds + self.client_seconds + self.held_seconds
        return max(0.0, self.elapsed_ms() - waited * 1000)

    def waiting_on_client(
            self, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """`call` (the ASGI receive or send) with the time it blocks kept apart: a client
        that uploads slowly or stops reading is not the gateway's overhead."""
        async def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return await call(*args)
            finally:
                self.client_seconds += time.perf_counter() - started
        return timed

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
            adapter=self.route.adapter,
        )

    def interrupted_report(self) -> UsageReport:
        """The record to store should this process die now: the usage so far, and the
        prompt as estimated when the engine has not yet said."""
        report = self.report()
        return replace(report, status_code=INTERRUPTED_STATUS, error_code=INTERRUPTED_CODE,
                       prompt_tokens=self.traced_usage()[0])

    def traced_usage(self) -> tuple[int, int, int]:
        """The tokens its trace holds once written now (interrupted_report)."""
        return (self.prompt_tokens if self.usage_seen else self.estimated_prompt_tokens,
                self.completion_tokens, self.cached_tokens)
