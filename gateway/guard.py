"""Failed authentication counted per client address, in this process's memory: an address
that keeps sending unknown keys is refused before its keys cost a database read each, so a
flood of made-up keys cannot stall the gateway for everyone."""

from __future__ import annotations

import math
import time

WINDOW_SECONDS = 60.0
# Past this many remembered addresses the memory is started afresh.
MAX_REMEMBERED_ADDRESSES = 100_000


class AuthFailures:
    def __init__(self, *, per_minute: int) -> None:
        self._per_minute = per_minute
        self._windows: dict[str, tuple[float, int]] = {}  # address: window start, failures

    def seconds_blocked(self, address: str) -> int:
        """Whole seconds until `address` may try a key again; 0 when it may now."""
        start, failures = self._windows.get(address, (0.0, 0))
        left = start + WINDOW_SECONDS - time.monotonic()
        if failures < self._per_minute or left <= 0:
            return 0
        return math.ceil(left)

    def record(self, address: str) -> None:
        now = time.monotonic()
        start, failures = self._windows.get(address, (now, 0))
        if now - start >= WINDOW_SECONDS:
            start, failures = now, 0
        if len(self._windows) >= MAX_REMEMBERED_ADDRESSES:
            self._windows.clear()
        self._windows[address] = (start, failures + 1)
