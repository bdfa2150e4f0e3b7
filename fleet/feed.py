"""The node channel's long poll, GET /node/v1/work: a node agent learns its work here.

The answer is the node's work as its rows state it (fleet.selectors.node_work), with a
version. Given the version it saw (`?seen=`), the poll answers once the work differs, or
after `?wait=` seconds (at most WAIT_MOST_SECONDS) with the same: a change wakes it at once
through Redis (endpoints.dispatch), and it looks again every LOOK_AGAIN_SECONDS all the
same, so a wake lost while Redis restarts costs seconds, never a start. Being level-
triggered, nothing is lost or doubled: a node that was away reads its work whole when it
returns, and a start it is already on is the same start.

An async view of its own (not DRF's): a poll waits on Redis, not on a database connection
(each read closes its own). It is one call per node every WAIT_MOST_SECONDS, not counted by
the channel's per-node throttle. The web process's middleware is synchronous, so Django
gives each poll a thread of its own while it waits.
"""

import asyncio
import math
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http import HttpRequest, JsonResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError

from endpoints.dispatch import node_work_channel
from endpoints.models import Node
from fleet import selectors
from fleet.enrolment import do_use_node_credential

WAIT_MOST_SECONDS = 25.0
LOOK_AGAIN_SECONDS = 5.0


def _refused(status: int, kind: str, message: str) -> JsonResponse:
    return JsonResponse({"error": {"type": kind, "message": message, "fields": {}}},
                        status=status)


def _caller(request: HttpRequest) -> Node | None:
    keyword, _, secret = request.headers.get("Authorization", "").partition(" ")
    try:
        return do_use_node_credential(secret=secret.strip()) if keyword == "Bearer" else None
    finally:
        close_old_connections()


def _work(node: Node) -> dict[str, Any]:
    try:
        return selectors.node_work(node=node)
    finally:
        close_old_connections()  # none held while the poll waits


async def work(request: HttpRequest) -> JsonResponse:
    if request.method != "GET":
        return _refused(405, "method_not_allowed", "The node's work is read with GET.")
    node = await sync_to_async(_caller)(request)
    if node is None:
        return _refused(401, "authentication_failed",
                        "This node credential is unknown or revoked; enrol the node anew with "
                        "a join token from an operator.")
    try:
        wait = float(request.GET.get("wait", WAIT_MOST_SECONDS))
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait):
        return _refused(400, "invalid", "wait is a number of seconds.")
    wait = min(max(wait, 0.0), WAIT_MOST_SECONDS)
    answer = await _when_changed(node, seen=request.GET.get("seen", ""), wait=wait)
    return JsonResponse(answer)


async def _when_changed(node: Node, *, seen: str, wait: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    read = sync_to_async(_work)
    listener = Redis.from_url(settings.REDIS_URL,
                              socket_connect_timeout=settings.KVRUN_REDIS_TIMEOUT_SECONDS)
    try:
        async with listener.pubsub() as pubsub:
            try:  # subscribed before the work is read: a change after the read wakes it
                await pubsub.subscribe(node_work_channel(node.id))
                subscribed = True
            except (RedisError, OSError):
                subscribed = False
            while True:
                answer = await read(node)
                left = deadline - loop.time()
                if answer["version"] != seen or left <= 0:
                    return answer
                pause = min(left, LOOK_AGAIN_SECONDS)
                try:
                    if not subscribed:
                        raise RedisError("not subscribed")
                    await pubsub.get_message(ignore_subscribe_messages=True, timeout=pause)
                except (RedisError, OSError):
                    subscribed = False
                    await asyncio.sleep(pause)
    finally:
        await listener.aclose()
