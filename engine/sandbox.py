"""Each engine in a sandbox of its own (bubblewrap). Pure Python, no Django.

An engine runs weights and, where an operator allows it, code its tenant chose, so it is
kept from everything but what it serves with:
- a user namespace of its own, in which it is an unprivileged user with no capabilities;
- a PID namespace of its own: its /proc shows its own processes only, so neither the
  agent's environment and memory nor another engine's are in its reach;
- a mount namespace holding the system's programs and libraries, Python and vLLM, kvrun's
  `engine` package, all read-only, its model's files read-only, its replica's own directory
  writable (KV tiers on disk, LMCache's config, HOME) with its adapters read-only inside it,
  and a private /tmp and /dev/shm. Nothing else of the host's files is there: not the
  agent's state directory, nor other replicas' directories, nor the engines' logs (the
  agent hands each engine its log as an open file);
- for a GPU engine, its own devices and the driver's control devices.
It shares the node's network, to serve on its port.

bubblewrap is the distribution's sandbox tool (`bwrap`, Debian's `bubblewrap` package); the
node agent needs it, and a host that refuses it new namespaces (a container under a default
seccomp profile) fails each start with bwrap's reason.

`bwrap`'s own command line carries who started the engine and for which replica
(`marked`): how an agent finds its engines again after a restart, without reading anything
an engine can change.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

TOOL = "bwrap"
# The engine's user inside its namespace: mapped to the agent's own user outside, so it
# reads and writes what it is given as the agent would, and nothing it is not given.
INSIDE_UID = INSIDE_GID = 1000
ADAPTERS = "adapters"  # under the replica's directory, read-only inside the sandbox
# What every program needs of the host, read-only; those a system lacks are left out. Of
# /etc only what the dynamic linker, name lookups and time zones read: an operator's files
# there (a node's environment file, keys, /etc/shadow for a root agent) stay out of reach.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/sys",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                "/etc/localtime", "/etc/hosts", "/etc/nsswitch.conf", "/etc/passwd",
                "/etc/group")
# The driver's control devices a CUDA engine opens beside its GPUs.
NVIDIA_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                          "/dev/nvidia-modeset")
# Marks in bwrap's command line, read back by `marks_of`.
OWNER_MARK, REPLICA_MARK = "KVRUN_ENGINE_OWNER", "KVRUN_ENGINE_REPLICA"


def code_root() -> Path:
    """The folder that holds kvrun's `engine` package, which an engine imports (its
    middleware): only that package of it is in the sandbox."""
    return Path(__file__).resolve().parent.parent


def python_paths() -> list[str]:
    """The interpreter's and its environment's folders, as named and as resolved (a link
    such as a venv's `bin/python` may go through either)."""
    return sorted({path for prefix in (sys.base_prefix, sys.prefix)
                   for path in (prefix, str(Path(prefix).resolve()))})


def marked(*, owner: str, replica: str) -> list[str]:
    return ["--setenv", OWNER_MARK, owner, "--setenv", REPLICA_MARK, replica]


def marks_of(argv: list[str]) -> tuple[str, str] | None:
    """(owner, replica) of a sandbox's command line, read where `command` puts them (never
    from the engine's own arguments); None when `argv` is not one."""
    start = len(_OPENING)
    if argv[:start] != _OPENING or argv[start:start + 6:3] != ["--setenv", "--setenv"] or (
            argv[start + 1], argv[start + 4]) != (OWNER_MARK, REPLICA_MARK):
        return None
    return argv[start + 2], argv[start + 5]


# How every sandbox's command line begins, its marks next.
_OPENING = [TOOL, "--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_GID),
            "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--cap-drop", "ALL"]


def command(argv: list[str], *, owner: str, replica: str, model_dir: str,
            replica_dir: str = "", compile_cache: str = "",
            devices: Iterable[int] = ()) -> list[str]:
    """`argv` (an engine's command) run in its sandbox. `replica_dir` is the replica's
    own directory (it must exist; "" for none): writable, with its `adapters` folder
    read-only. `compile_cache` (it must exist; "" for none) is writable too and kept from
    one start to the next: vLLM's, PyTorch's and Triton's caches, without which every start
    inspects and compiles anew (about 20 s on a CPU engine of the demo model). The
    engine's environment is the one bwrap is started with."""
    wrapped = [*_OPENING, *marked(owner=owner, replica=replica),
               # First, so that what is bound below may lie under /tmp.
               "--proc", "/proc", "--dev", "/dev",
               "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs", "/dev/shm"]
    for path in SYSTEM_PATHS:
        wrapped += ["--ro-bind-try", path, path]
    for path in python_paths():
        wrapped += ["--ro-bind", path, path]
    engine_package = str(code_root() / "engine")
    wrapped += ["--ro-bind", engine_package, engine_package,
                "--setenv", "PYTHONPATH", str(code_root()),
                "--ro-bind", model_dir, model_dir]
    home = "/tmp"
    if replica_dir:
        adapters = str(Path(replica_dir) / ADAPTERS)
        wrapped += ["--bind", replica_dir, replica_dir, "--ro-bind", adapters, adapters]
        home = replica_dir
    if compile_cache:
        wrapped += ["--bind", compile_cache, compile_cache]
        for variable, folder in (("XDG_CACHE_HOME", ""), ("VLLM_CACHE_ROOT", "vllm"),
                                 ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
                                 ("TRITON_CACHE_DIR", "triton")):
            wrapped += ["--setenv", variable, str(Path(compile_cache) / folder)]
    indices = list(devices)
    for device in [f"/dev/nvidia{index}" for index in indices] + (
            list(NVIDIA_CONTROL_DEVICES) if indices else []):
        if Path(device).exists():
            wrapped += ["--dev-bind", device, device]
    # Named by the environment: a user the host may not know by its uid.
    wrapped += ["--setenv", "HOME", home, "--setenv", "USER", "engine",
                "--setenv", "LOGNAME", "engine", "--chdir", home, "--", *argv]
    return wrapped


def offer(source: Path, target: Path) -> Path:
    """Make the files of folder `source` visible to an engine as folder `target` under its
    replica's `adapters` folder (read-only inside the sandbox): hard links, or copies where
    `source` is on another file system; written beside and renamed, so the engine never
    sees half of it. One already there is kept."""
    if target.is_dir():
        return target
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}.partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, partial, copy_function=_link_or_copy)
    try:
        partial.rename(target)
    except OSError:  # another offer of the same folder finished first: keep its copy
        shutil.rmtree(partial, ignore_errors=True)
        if not target.is_dir():
            raise
    return target


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)
