"""`make run` end to end: embedded services, every process up, Ctrl-C leaves nothing behind."""

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from engine.processes import dying_with_parent, free_port, owner_of, running_engines
from kvrun import launcher
from tests.helpers import ROOT, api_servers, engine_processes, process_alive, wait_until


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


class Launch:
    started: list["Launch"] = []

    def __init__(self, state_dir: Path, port: int) -> None:
        Launch.started.append(self)
        env = {**Launch.environment(state_dir), "KVRUN_PORT": str(port)}
        self.process = subprocess.Popen([sys.executable, "-m", "kvrun.launcher", "run"], cwd=ROOT,
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, preexec_fn=dying_with_parent)
        self.output: list[str] = []

    @staticmethod
    def environment(state_dir: Path) -> dict[str, str]:
        """A person's shell: none of the suite's services or secrets, the state directory."""
        env = {k: v for k, v in os.environ.items()
               if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "KVRUN_KEY_PEPPER", "DEBUG",
                            "KVRUN_BASE_URL"}}
        env.update(KVRUN_STATE_DIR=str(state_dir), KVRUN_NODE_NAME="launch-test",
                   KVRUN_NODE_GPUS="none")
        return env

    def read_until(self, marker: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line and self.process.poll() is not None:
                break
            self.output.append(line)
            if marker in line:
                return "".join(self.output)
        raise AssertionError(f"no {marker!r} in:\n{''.join(self.output)}")

    def interrupt(self) -> int:
        self.process.send_signal(signal.SIGINT)
        rest, _ = self.process.communicate(timeout=90)
        self.output.append(rest)
        return self.process.returncode


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


@pytest.fixture(autouse=True)
def no_launch_left() -> Iterator[None]:
    """A launch a failed test left running is stopped as Ctrl-C would: its web process,
    workers and beat would otherwise run on, and weigh on every later test and benchmark."""
    yield
    for launch in Launch.started:
        if launch.process.poll() is None:
            launch.interrupt()
    Launch.started.clear()


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError("readyz never answered 200")


@pytest.mark.e2e
def test_make_run_starts_everything_and_ctrl_c_leaves_nothing(state_dir: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    first = Launch(state_dir, port)
    output = first.read_until("Ctrl-C stops every process")
    wait_ready(base)
    password = re.search(r"password: (\S+)", output).group(1)
    secret = re.search(r"Bearer (kvr_\w+)", output).group(1)
    models = httpx.get(f"{base}/api/v1/models/", headers={"Authorization": f"Bearer {secret}"})
    assert models.status_code == 200 and models.json()["count"] >= 15
    # Every URL it prints (the web server's own line among them) names the port it was
    # given and is served; the wizard's leads a newcomer there through sign-in.
    printed = re.findall(r"https?://[^\s'\"]+", output)
    assert printed and all(f"{url}/".startswith(f"{base}/") for url in printed), printed
    for url in printed:
        assert httpx.get(url, headers={"Authorization": f"Bearer {secret}"}).status_code in (
            200, 302), url
    wizard = httpx.get(f"{base}/endpoints/new/")
    assert wizard.headers["location"] == "/login/?next=/endpoints/new/"
    processes = descendants(first.process.pid)
    postmaster = int((state_dir / "postgres" / "postmaster.pid").read_text().split()[0])
    assert len(processes) >= 5  # web, worker (+ its pool), beat, node agent, redis
    assert first.interrupt() == 0
    # No worker's start-up banner (Celery's, of the control worker or the node agent's) came
    # to scroll the URLs away.
    assert "[queues]" not in "".join(first.output)
    # The launcher exits only once everything it started has stopped.
    assert not [pid for pid in processes | {postmaster} if process_alive(pid)], "orphaned processes"

    second = Launch(state_dir, port)
    output = second.read_until("Ctrl-C stops every process")
    wait_ready(base)
    assert "password shown at first run" in output and password not in output
    with httpx.Client(base_url=base) as browser:
        browser.get("/login/")
        signed_in = browser.post("/login/", data={
            "username": "admin@example.com", "password": password,
            "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
            headers={"Referer": f"{base}/login/"})
        assert signed_in.status_code == 302, "the first run's password no longer works"
    processes = descendants(second.process.pid)
    assert second.interrupt() == 0
    assert not [pid for pid in processes if process_alive(pid)]


@pytest.mark.e2e
def test_make_run_stops_everything_and_fails_when_one_of_its_processes_dies(
        state_dir: Path) -> None:
    port = free_port()
    launch = Launch(state_dir, port)
    launch.read_until("Ctrl-C stops every process")
    processes = descendants(launch.process.pid)
    # Its argv, or once beat has set its process title one string: "[celery beat] … beat …".
    [beat] = [pid for pid in processes
              if b"beat" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()]

    os.kill(beat, signal.SIGKILL)
    code = launch.process.wait(90)
    output = "".join(launch.output) + launch.process.stdout.read()

    assert code == 1
    assert "beat exited with status -9; stopping everything" in output
    assert not [pid for pid in processes if process_alive(pid)], "orphaned processes"


@pytest.mark.e2e
def test_a_sigkilled_launcher_leaves_only_the_embedded_postgresql(state_dir: Path) -> None:
    port = free_port()
    launch = Launch(state_dir, port)
    launch.read_until("Ctrl-C stops every process")
    wait_ready(f"http://127.0.0.1:{port}")
    processes = descendants(launch.process.pid)
    postmaster = int((state_dir / "postgres" / "postmaster.pid").read_text().split()[0])
    assert len(processes) >= 5  # web, worker (+ its pool), beat, node agent, redis
    try:
        launch.process.kill()
        launch.process.wait(30)

        # Each child is told to die with the launcher; they are all gone once they have
        # shut down, and the PostgreSQL daemon, which the next run reuses, is left.
        assert wait_until(lambda: not any(process_alive(pid) for pid in processes), 30), [
            pid for pid in processes if process_alive(pid)]
        assert process_alive(postmaster)
    finally:
        for pid in processes | {postmaster}:
            if process_alive(pid):
                os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown; others stop too
    assert wait_until(lambda: not process_alive(postmaster), 30)


def test_an_embedded_postgresql_restarted_under_the_launcher_stops_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pgserver
    import psutil

    monkeypatch.setattr(launcher, "STATE_DIR", tmp_path)
    services = launcher.Services()
    services._start_postgres()
    data = tmp_path / "postgres"
    server = pgserver.get_server(data)  # the launcher's own handle
    socket_dir, user = server.get_postmaster_info().socket_dir, server.system_user
    try:
        # What the fault suite does to the suite's PostgreSQL.
        pgserver.pg_ctl(["stop", "-m", "fast", "-w"], pgdata=data, user=user)
        pgserver.pg_ctl(["start", "-w", "-o", f"-h '' -k {socket_dir}"], pgdata=data, user=user)
        # As on a host whose init reaps the first postmaster: pgserver sees it gone, and
        # left the restarted one running (a CI clone's was).
        monkeypatch.setattr(psutil.Process, "is_running", lambda self: False)

        services.stop()

        assert not (data / "postmaster.pid").exists()
    finally:
        if (data / "postmaster.pid").exists():
            pgserver.pg_ctl(["stop", "-m", "immediate", "-w"], pgdata=data, user=user)


def test_the_embedded_postgresql_a_killed_launcher_left_stops_with_the_next_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "postgres"
    # A launcher SIGKILLed while PostgreSQL ran: the server stays, and so does the launcher's
    # pid in pgserver's list of the server's users.
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, pathlib; from kvrun import launcher; "
        f"launcher.STATE_DIR = pathlib.Path({str(tmp_path)!r}); "
        "launcher.Services()._start_postgres(); os.kill(os.getpid(), signal.SIGKILL)")],
        cwd=ROOT, env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    assert killed.returncode == -signal.SIGKILL
    assert (data / "postmaster.pid").exists()
    monkeypatch.setattr(launcher, "STATE_DIR", tmp_path)
    services = launcher.Services()
    try:
        services._start_postgres()
        services.stop()

        assert not (data / "postmaster.pid").exists()
    finally:
        if (data / "postmaster.pid").exists():
            import pgserver
            # As pgserver runs it: as its own user under root.
            pgserver.pg_ctl(["stop", "-m", "immediate", "-w"], pgdata=data,
                            user="pgserver" if os.geteuid() == 0 else None)


def test_secrets_missing_from_an_older_state_directory_are_added_and_kept_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "STATE_DIR", tmp_path)
    (tmp_path / "secrets.json").write_text('{"SECRET_KEY": "old", "KVRUN_KEY_PEPPER": "kept"}')

    made = launcher.load_or_create_secrets()

    assert (made["SECRET_KEY"], made["KVRUN_KEY_PEPPER"]) == ("old", "kept")
    assert len(made["REDIS_PASSWORD"]) >= 32
    assert launcher.load_or_create_secrets() == made
    assert (tmp_path / "secrets.json").stat().st_mode & 0o777 == 0o600


def test_the_embedded_redis_demands_its_password_and_no_command_line_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "STATE_DIR", tmp_path)
    monkeypatch.delenv("REDIS_URL")  # DATABASE_URL stays: only Redis is started
    password = secrets.token_urlsafe(16)
    services = launcher.Services()
    try:
        url = services.start(redis_password=password, redis_dir=tmp_path / "redis")["REDIS_URL"]
        address = urlsplit(url)

        assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.RedisError, match="(?i)auth"):
            redis.Redis(host=address.hostname, port=address.port).ping()
        shown = [path for path in Path("/proc").glob("[0-9]*/cmdline")
                 if password.encode() in _read(path)]
        assert not shown
    finally:
        services.stop()


def test_tests_and_benchmarks_keep_their_redis_data_apart_from_make_run_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tests empty kvrun's keys: in make run's Redis, its usage not yet in PostgreSQL.
    monkeypatch.setattr(launcher, "STATE_DIR", tmp_path)
    monkeypatch.delenv("REDIS_URL")  # DATABASE_URL stays: only Redis is started
    environment = dict(os.environ)
    folders: dict[bool, Path] = {}
    try:
        for own_redis in (False, True):
            os.environ.pop("REDIS_URL", None)  # the last one's, which prepare_environment set
            services, env = launcher.prepare_environment(own_redis=own_redis)
            try:
                # Where the Redis that started keeps its data, as it says itself.
                folders[own_redis] = Path(
                    redis.Redis.from_url(env["REDIS_URL"]).config_get("dir")["dir"])
            finally:
                services.stop()
    finally:
        os.environ.clear()
        os.environ.update(environment)

    kept, own = folders[False], folders[True]
    assert kept == tmp_path / "redis" and kept.is_dir()
    assert own.parent == tmp_path and own != kept and not own.exists()  # deleted after


def manage(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m kvrun.launcher manage ARGS` as a person types it beside `make run`."""
    return subprocess.run([sys.executable, "-m", "kvrun.launcher", "manage", *args], cwd=ROOT,
                          env=Launch.environment(state_dir), capture_output=True, text=True,
                          timeout=120)


REDIS_PORT_OF_MANAGE = ("from django.conf import settings; "
                        "print('port', settings.REDIS_URL.rsplit(':', 1)[1].split('/')[0])")


@pytest.mark.e2e
def test_a_management_command_beside_make_run_uses_its_services(state_dir: Path) -> None:
    port = free_port()
    launch = Launch(state_dir, port)
    output = launch.read_until("Ctrl-C stops every process")
    redis_port = re.search(r"Redis \(embedded\) at 127\.0\.0\.1:(\d+)", output)[1]
    log = state_dir / "redis" / "redis.log"

    beside = manage(state_dir, "shell", "-c", REDIS_PORT_OF_MANAGE + "; from kvrun.common.redis "
                    "import redis_client; redis_client().set('kvrun:test:manage', 'beside')")
    second = Launch(state_dir, free_port())
    refused = second.process.wait(60)
    second.output.append(second.process.stdout.read())

    assert beside.returncode == 0, beside.stderr
    assert "using the services of the `make run` that is up" in beside.stdout
    assert f"port {redis_port}" in beside.stdout
    assert log.read_text().count("Ready to accept connections") == 1  # one server on the data
    assert refused == 1 and "another `make run` is running" in "".join(second.output)
    assert launch.interrupt() == 0
    assert not (state_dir / "run.json").exists()

    # With no `make run` up, a Redis of its own, in a directory of its own, deleted after.
    alone = manage(state_dir, "shell", "-c", REDIS_PORT_OF_MANAGE)

    assert alone.returncode == 0, alone.stderr
    assert "using the services" not in alone.stdout
    assert f"port {redis_port}" not in alone.stdout
    assert log.read_text().count("Ready to accept connections") == 1
    assert sorted(path.name for path in state_dir.iterdir() if path.name.startswith("redis")) == [
        "redis"]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.e2e
def test_ctrl_c_while_an_engine_loads_leaves_no_engine(state_dir: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    launch = Launch(state_dir, port)
    output = launch.read_until("Ctrl-C stops every process")
    wait_ready(base)
    secret = re.search(r"Bearer (kvr_\w+)", output).group(1)
    slug = re.search(r"Quickstart key for (\S+),", output).group(1)
    created = httpx.post(f"{base}/api/v1/organizations/{slug}/endpoints/",
                         headers={"Authorization": f"Bearer {secret}"},
                         json={"name": "interrupted", "model": "kvrun-demo-tiny",
                               "context_length": 2048, "concurrency": 4})
    assert created.status_code == 201, created.text
    # Sized for this node, online before the run said it was up.
    assert created.json()["gpu_type"] == "cpu", created.text

    # Its engine has started its workers and loads: it puts off SIGTERM until it has loaded.
    assert wait_until(lambda: any(len(engine_processes(os.getpgid(pid))) > 1
                                  for pid in api_servers("interrupted")), 180)
    assert launch.interrupt() == 0

    assert not api_servers("interrupted"), "the engine outlived `make run`"
    assert not running_engines(owner_of("launch-test", state_dir))


def test_a_command_under_the_launcher_finishes_its_teardown_after_ctrl_c(tmp_path: Path) -> None:
    done = tmp_path / "torn-down"
    # A child whose teardown takes a second, as pytest's stopping its engines does.
    child = ("import pathlib, signal, sys, time\n"
             "def stop(*_):\n"
             f"    time.sleep(1); pathlib.Path({str(done)!r}).write_text('yes'); sys.exit(0)\n"
             "signal.signal(signal.SIGINT, stop)\n"
             "print('ready', flush=True); time.sleep(60)\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; from kvrun.launcher import run_to_end; "
         f"sys.exit(run_to_end([sys.executable, '-c', {child!r}], env=dict(os.environ)))"],
        cwd=ROOT, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout.readline() == b"ready\n"
        os.killpg(parent.pid, signal.SIGINT)  # Ctrl-C: the whole process group

        assert parent.wait(15) == 0
        assert done.read_text() == "yes"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


def test_the_embedded_redis_is_bounded_and_evicts_only_what_expires_anyway(
        tmp_path: Path) -> None:
    """Under volatile-lru only keys with an expiry go, least recently used first; the
    broker's queues, the usage stream and the running requests' traces have none."""
    services = launcher.Services()
    url = services._start_redis("a-password", tmp_path / "redis")
    try:
        client = redis.Redis.from_url(url)
        assert client.config_get("maxmemory") == {"maxmemory": str(2**30)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
    finally:
        services.stop()
