import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine import sandbox
from engine.processes import (
    ENGINE_NICENESS,
    command_line_of,
    engine_group_dying_with_parent,
    engine_session_yields,
    live_processes,
    owner_of,
    port_is_free,
    running_engines,
    stop_group,
    stop_groups,
)
from tests.helpers import UP_AND_ASLEEP, process_alive, said, sandboxed, wait_until


def test_stop_group_ends_a_process_that_ignores_sigterm() -> None:
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "up"

    started = time.monotonic()
    stop_group(stubborn.pid, grace=1.0)
    stubborn.wait(5)

    assert not process_alive(stubborn.pid)
    assert time.monotonic() - started < 5


def test_port_is_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def test_a_port_whose_server_closed_its_connections_is_free() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as an engine binds
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server closes first: its side lingers in TIME_WAIT
        client.recv(1)
        client.close()
    assert port_is_free(port)


def test_engines_are_found_by_their_sandbox_s_marks_never_by_what_an_engine_writes(
        tmp_path: Path) -> None:
    mine = owner_of("node-1", "/srv/kvrun")
    # An engine that rewrites its own command line into a sandbox's, marked as one of
    # node-1's: it runs in the engine's own PID namespace, so it is not taken for one.
    forged = "\0".join(sandbox.command(["x"], owner=mine, replica="r-forged", model_dir="/"))
    forging = (
        "stat = open('/proc/self/stat').read().rsplit(')', 1)[1].split()\n"
        "start, end = int(stat[45]), int(stat[46])  # where the kernel keeps its arguments\n"
        f"forged = {forged!r}.encode() + b'\\0'\n"
        "with open('/proc/self/mem', 'r+b') as memory:\n"
        "    memory.seek(start)\n"
        "    memory.write(forged.ljust(end - start, b'\\0'))\n"
        + UP_AND_ASLEEP)
    ours = sandboxed(UP_AND_ASLEEP, owner=mine, replica="r-1", model_dir=tmp_path,
                     log_path=tmp_path / "r-1.log")
    theirs = sandboxed(UP_AND_ASLEEP, owner=owner_of("node-2", "/srv/kvrun"), replica="r-2",
                       model_dir=tmp_path, log_path=tmp_path / "r-2.log")
    forger = sandboxed(forging, owner=owner_of("node-3", "/srv/kvrun"), replica="r-3",
                       model_dir=tmp_path, log_path=tmp_path / "r-3.log")
    try:
        assert all(said(tmp_path / f"r-{n}.log", "up") for n in (1, 2, 3))

        [rewritten] = [pid for pid, _ in live_processes()
                       if sandbox.marks_of(command_line_of(pid)) == (mine, "r-forged")]
        assert running_engines(mine) == {"r-1": {ours.pid}}
        assert running_engines(owner_of("node-3", "/srv/kvrun")) == {"r-3": {forger.pid}}
        stop_groups({ours.pid}, grace=5.0)
        ours.wait(5)
        assert running_engines(mine) == {}
    finally:
        for process in (ours, theirs, forger):
            stop_groups({process.pid}, grace=0.0)
            process.wait()


def test_a_sandbox_s_marks_are_read_where_it_puts_them_only() -> None:
    marked = sandbox.command(["python", "serve.py"], owner="node-1@/srv", replica="r-1",
                             model_dir="/models/m")
    assert sandbox.marks_of(marked) == ("node-1@/srv", "r-1")
    # An engine's own arguments that look like marks are not its sandbox's.
    assert sandbox.marks_of(["bwrap", "--setenv", "KVRUN_ENGINE_OWNER", "node-1@/srv",
                             "--setenv", "KVRUN_ENGINE_REPLICA", "r-1"]) is None
    assert sandbox.marks_of(marked[:12]) is None
    assert sandbox.marks_of([]) is None


def test_a_stop_lets_an_engine_shut_down_before_its_sandbox_ends(tmp_path: Path) -> None:
    engine = sandboxed(
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    print('shutting down', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True); time.sleep(60)\n",
        owner="node-1@/srv", replica="r-1", model_dir=tmp_path, log_path=tmp_path / "log")
    assert said(tmp_path / "log", "up")

    assert stop_groups({engine.pid}, grace=10.0) is False  # no SIGKILL was needed

    assert engine.wait(5) == 0  # the sandbox ended with its engine's own exit
    assert said(tmp_path / "log", "shutting down", timeout=0)


def test_an_engine_started_in_its_own_group_ends_when_its_agent_is_killed() -> None:
    # The agent, killed outright (SIGKILL: no clean-up of its own runs), with one engine.
    agent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys\n"
         "from engine.processes import own_group_dying_with_parent\n"
         "engine = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
         "                          preexec_fn=own_group_dying_with_parent)\n"
         "print(engine.pid, flush=True)\n"
         "engine.wait()\n"],
        stdout=subprocess.PIPE, text=True)
    engine = int(agent.stdout.readline())
    assert process_alive(engine)

    agent.kill()
    agent.wait()

    assert wait_until(lambda: not process_alive(engine), 15), "the engine outlived its agent"


def test_engines_run_below_the_processes_of_their_node() -> None:
    # Two at once: the kernel lets a group's niceness change only so often.
    engines = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                preexec_fn=engine_group_dying_with_parent) for _ in range(2)]
    try:
        assert all(engine_session_yields(engine.pid) for engine in engines)
        for engine in engines:
            assert os.getpriority(os.PRIO_PROCESS, engine.pid) == max(
                ENGINE_NICENESS, os.getpriority(os.PRIO_PROCESS, 0))
            assert os.getsid(engine.pid) == engine.pid != os.getsid(0)
            group = Path(f"/proc/{engine.pid}/autogroup")
            if group.exists():  # the kernel schedules sessions as groups: the group yields
                name, niceness = group.read_text().split(" nice ")
                assert name != Path("/proc/self/autogroup").read_text().split(" nice ")[0]
                assert int(niceness) == ENGINE_NICENESS
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
