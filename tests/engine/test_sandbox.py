"""An engine's sandbox (engine.sandbox), tried by a hostile program started exactly as an
engine is (engine.supervisor.launch), beside another tenant's engine."""

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from engine import sandbox, supervisor
from engine.processes import free_port, stop_groups
from engine.sizing import CPU
from tests.helpers import wait_until

# What a prompt-reachable bug in an engine could run: it tries everything the sandbox must
# refuse, then serves on its port as an engine does, answering with what it found.
HOSTILE = r'''
import http.server, json, os, sys

agent_pid, other_dir, other_log, secrets, model_dir, own_dir = sys.argv[1:7]
found = {"processes": {}}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            found["processes"][pid] = open(f"/proc/{pid}/cmdline", "rb").read().decode(
                errors="replace")
        except OSError as exc:
            found["processes"][pid] = type(exc).__name__

def attempt(name, action):
    try:
        action()
        found[name] = "done"
    except OSError as exc:
        found[name] = type(exc).__name__

def read(path):
    with open(path, "rb") as handle:
        handle.read()

def write(path):
    with open(path, "wb") as handle:
        handle.write(b"x")

attempt("read the agent's environment", lambda: read(f"/proc/{agent_pid}/environ"))
attempt("read the agent's memory", lambda: read(f"/proc/{agent_pid}/mem"))
attempt("list another engine's directory", lambda: os.listdir(other_dir))
attempt("read another engine's KV tier", lambda: read(os.path.join(other_dir, "disk.kv")))
attempt("read another engine's log", lambda: read(other_log))
attempt("read the control plane's secrets", lambda: read(secrets))
attempt("read its model", lambda: read(os.path.join(model_dir, "config.json")))
attempt("change its model", lambda: write(os.path.join(model_dir, "config.json")))
attempt("change its adapters", lambda: write(os.path.join(own_dir, "adapters", "a")))
attempt("write its own directory", lambda: write(os.path.join(own_dir, "disk.kv")))
attempt("read the host's passwords", lambda: read("/etc/shadow"))

def user_namespace():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER: where kernel exploits usually begin
        raise OSError(ctypes.get_errno(), "refused")

attempt("make a user namespace", user_namespace)
found["uid"], found["environment"] = os.getuid(), dict(os.environ)
body = json.dumps(found).encode()

class Report(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Report).serve_forever()
'''


def spec(tmp_path: Path, name: str, port: int) -> supervisor.EngineSpec:
    model = tmp_path / f"model-{name}"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "hostile.py").write_text(HOSTILE)
    return supervisor.EngineSpec(
        model_dir=str(model), served_model_name=name, port=port, max_model_len=2048,
        max_num_seqs=2, device=CPU, cache_dir=str(tmp_path / "state" / "kv" / name),
        api_key=f"key-of-{name}", owner="node-1@" + str(tmp_path / "state"), replica=name)


def test_a_hostile_engine_reaches_nothing_beyond_its_own_replica_and_still_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The agent holds secrets in its environment (until nodes hold only their credential).
    for name in ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "KVRUN_KEY_PEPPER", "HF_TOKEN"):
        monkeypatch.setenv(name, f"the agent's {name}")
    (tmp_path / "state").mkdir()
    secrets = tmp_path / "state" / "secrets.json"
    secrets.write_text('{"SECRET_KEY": "not for engines"}')
    logs = tmp_path / "logs"
    other, hostile = spec(tmp_path, "other", free_port()), spec(tmp_path, "hostile", free_port())
    started = [supervisor.launch(
        [sys.executable, "-c", "import time; print('serving', flush=True); time.sleep(60)"],
        {}, spec=other, log_path=logs / "other.log")]
    try:
        assert wait_until(lambda: (logs / "other.log").read_text() == "serving\n", 30)
        (Path(other.cache_dir) / "disk.kv").write_text("another tenant's cache")
        started.append(supervisor.launch(
            [sys.executable, str(Path(hostile.model_dir) / "hostile.py"), str(os.getpid()),
             other.cache_dir, str(logs / "other.log"), str(secrets), hostile.model_dir,
             hostile.cache_dir],
            {"PORT": str(hostile.port), "VLLM_API_KEY": hostile.api_key}, spec=hostile,
            log_path=logs / "hostile.log"))

        def report() -> dict | None:
            try:
                return httpx.get(f"http://127.0.0.1:{hostile.port}/").json()
            except httpx.HTTPError:
                return None
        assert wait_until(lambda: report() is not None, 30), (logs / "hostile.log").read_text()
        found = report()
    finally:
        stop_groups({process.pid for process in started}, grace=1.0)
        for process in started:
            process.wait(10)

    assert found is not None
    # It sees its own processes only: its sandbox's init and itself.
    assert len(found["processes"]) <= 2, found["processes"]
    assert all("hostile.py" in line or "bwrap" in line for line in found["processes"].values())
    for refused in ("read the agent's environment", "read the agent's memory",
                    "list another engine's directory", "read another engine's KV tier",
                    "read another engine's log", "read the control plane's secrets",
                    "read the host's passwords"):
        assert found[refused] == "FileNotFoundError", (refused, found[refused])
    assert found["make a user namespace"] in ("PermissionError", "OSError")  # not "done"
    assert found["change its model"] == found["change its adapters"] == "OSError"  # read-only
    assert found["read its model"] == found["write its own directory"] == "done"
    assert (Path(hostile.cache_dir) / "disk.kv").read_bytes() == b"x"
    assert found["uid"] == sandbox.INSIDE_UID
    # Its environment is its own: nothing of the agent's beyond what an engine needs.
    assert found["environment"]["VLLM_API_KEY"] == "key-of-hostile"
    assert not {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "KVRUN_KEY_PEPPER", "HF_TOKEN"} & set(
        found["environment"])
    assert not [value for value in found["environment"].values() if "the agent's" in value]
    assert oct((logs / "hostile.log").stat().st_mode & 0o777) == "0o600"
    json.dumps(found)  # what it sent was all it could gather


def test_an_adapter_is_offered_to_an_engine_whole_by_hard_links(tmp_path: Path) -> None:
    source = tmp_path / "cache" / "hub" / "acme" / "lora" / "c0ffee"
    source.mkdir(parents=True)
    (source / "adapter_config.json").write_text('{"r": 8}')
    target = tmp_path / "replica" / sandbox.ADAPTERS / "hub" / "acme" / "lora" / "c0ffee"

    assert sandbox.offer(source, target) == target
    assert (target / "adapter_config.json").stat().st_ino == (
        source / "adapter_config.json").stat().st_ino
    assert not target.with_name("c0ffee.partial").exists()
    (source / "adapter_config.json").unlink()  # the cache evicts it: the engine's copy stays
    assert sandbox.offer(source, target) == target
    assert (target / "adapter_config.json").read_text() == '{"r": 8}'
