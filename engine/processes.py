"""Process groups and ports: how kvrun starts children that leave nothing behind.

Every long-lived child (an engine, or a service under the launcher) runs in a process group
of its own and is told to die with its parent, so that stopping it, or losing its parent,
ends the whole group: vLLM's API server and its engine-core workers together.
"""

import ctypes
import os
import signal
import socket
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def own_group_dying_with_parent() -> None:
    """In a child, before exec: a process group of its own, SIGTERM when the parent dies."""
    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_group(pgid: int, *, grace: float) -> bool:
    """SIGTERM a process group, then SIGKILL whatever is left after `grace` s.
    Returns True when SIGKILL was needed."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return False
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Members that are zombies still count for killpg; check that one is really running.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in {"Z", "X"}:
            return True
    return False
