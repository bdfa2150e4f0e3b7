import socket
import subprocess
import sys
import time

from engine.processes import port_is_free, stop_group
from tests.helpers import process_alive


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
