"""Prefix-affinity routing: requests whose prompts begin alike go to the same replica, whose
prefix cache then holds their common beginning (a system prompt, a document, the turns of a
conversation so far), instead of each replica computing it again.

A request's key is a hash of its prompt's leading characters with its cache salt, so one
tenant's prompts never steer another's. Keys and replicas share a consistent-hash ring (a
replica added or removed moves only the keys next to it), walked with bounded loads
(Mirrokni, Thorup and Zadimoghaddam, 2018): a replica is taken only while its requests in
flight are under LOAD_BOUND times the replicas' average, counting this one, and under the
endpoint's concurrency, past which its engine would queue. One hot prefix thus spills to the
next replica on the ring rather than piling up on one; when every replica is past its bound
the caller falls back to the least loaded. Everything here is in this process's memory: the
choice costs no round trip.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.directory import Upstream

# How much of a prompt decides its replica: about 256 tokens, sixteen 16-token blocks on a
# GPU and two 128-token blocks on a CPU engine. Prompts that share more than this share a
# replica; prompts that part earlier have little cache to share.
PREFIX_CHARACTERS = 1024
VIRTUAL_NODES = 64  # points per replica on the ring: an even share of the keys each
LOAD_BOUND = 1.25


def leading_prompt(payload: dict[str, Any]) -> bytes:
    """The first PREFIX_CHARACTERS of the prompt as the engine will see it: the system
    prompt (Anthropic's, apart from its messages), the messages' roles and texts in order,
    or the completion prompt (text, or token ids)."""
    parts: list[str] = []
    system = payload.get("system")
    for text in system if isinstance(system, list) else [system]:
        text = text.get("text") if isinstance(text, dict) else text
        if isinstance(text, str):
            parts.append(text)
    size = sum(len(part) for part in parts)
    for message in payload.get("messages") or ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        texts = content if isinstance(content, list) else [content]
        for text in [str(message.get("role"))] + [
                part.get("text") if isinstance(part, dict) else part for part in texts]:
            if isinstance(text, str):
                parts.append(text)
                size += len(text)
        if size >= PREFIX_CHARACTERS:
            break
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]  # a batch is routed by its first prompt
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts.append(",".join(str(token) for token in prompt[:PREFIX_CHARACTERS]))
    return "\x1f".join(parts)[:PREFIX_CHARACTERS].encode()


def prefix_key(payload: dict[str, Any], *, salt: str) -> int | None:
    """The request's place on the ring; None for a request with no prompt."""
    leading = leading_prompt(payload)
    if not leading:
        return None
    return _point(salt.encode() + b"\0" + leading)


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Ring:
    points: tuple[int, ...]
    owners: tuple[Upstream, ...]

    @classmethod
    def of(cls, upstreams: Iterable[Upstream]) -> Ring:
        placed = sorted(((_point(f"{upstream.replica_id}#{n}".encode()), upstream)
                         for upstream in upstreams for n in range(VIRTUAL_NODES)),
                        key=lambda pair: pair[0])
        return cls(points=tuple(point for point, _ in placed),
                   owners=tuple(upstream for _, upstream in placed))

    def owner(self, key: int) -> Upstream | None:
        """The replica `key` belongs to, loads aside: the first clockwise from it."""
        if not self.points:
            return None
        return self.owners[bisect.bisect(self.points, key) % len(self.points)]

    def choose(self, key: int, *, upstreams: Sequence[Upstream], tried: set[Upstream],
               concurrency: int) -> Upstream | None:
        """The first replica clockwise from `key` that is up, not yet tried, and under its
        load bound; None when there is none."""
        if not self.points:
            return None
        now = time.monotonic()
        in_flight = sum(upstream.in_flight for upstream in upstreams)
        bound = min(math.ceil(LOAD_BOUND * (in_flight + 1) / len(upstreams)), concurrency)
        seen: set[Upstream] = set()
        start = bisect.bisect(self.points, key)
        for step in range(len(self.points)):
            upstream = self.owners[(start + step) % len(self.points)]
            if upstream in seen:
                continue
            seen.add(upstream)
            if upstream not in tried and upstream.down_until <= now and upstream.in_flight < bound:
                return upstream
            if len(seen) == len(upstreams):
                break
        return None
