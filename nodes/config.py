"""A node agent's configuration: the control plane's URL, the join token it enrols with once,
and what belongs to its own host. Read from the environment; nothing here is a secret of the
control plane. How often to beat and how long to wait on engines, the control plane tells
the agent when it registers (Timings), so that both always agree."""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from engine import processes
from engine.supervisor import engine_environment

REPOSITORY = Path(__file__).resolve().parent.parent
# What a node agent reads of its environment (AgentConfig.from_environ, and the GPUs it may
# use: engine.devices).
VARIABLES = frozenset({
    "KVRUN_CONTROL_PLANE_URL", "KVRUN_JOIN_TOKEN", "KVRUN_NODE_ADDRESS", "KVRUN_STATE_DIR",
    "KVRUN_MODEL_DIR", "KVRUN_ENGINE_LOG_DIR", "KVRUN_HUB_URL", "KVRUN_MODEL_CACHE_GIB",
    "KVRUN_NODE_CPU_CORES_PER_ENGINE", "KVRUN_ENGINE_LOG_KEPT_DAYS", "KVRUN_NODE_GPUS"})


def agent_environment(inherited: Mapping[str, str], **values: str) -> dict[str, str]:
    """The environment a node agent is started with beside the control plane (`make run`,
    the tests, the benchmarks), as on a host of its own: from `inherited`, what its engines
    may inherit (engine.supervisor), HOME, and its own variables; then `values`. Nothing of
    the control plane's (its database, Redis, secret key, pepper) reaches it."""
    own = {name: value for name, value in inherited.items()
           if name in VARIABLES or name == "HOME"}
    return {**engine_environment(inherited, {}), **own, **values}


@dataclass(frozen=True)
class AgentConfig:
    control_plane_url: str = "http://127.0.0.1:8000"
    join_token: str = ""  # spent at the first start; the credential is kept after
    address: str = "127.0.0.1"  # where its engines listen, reachable from the web processes
    state_dir: Path = REPOSITORY / ".kvrun"
    model_dir: Path = REPOSITORY / ".kvrun" / "models"
    engine_log_dir: Path = REPOSITORY / ".kvrun" / "engines"
    hub_url: str = "https://huggingface.co"  # the hub (or its mirror) weights come from
    model_cache_gib: int = 100  # disk its model cache may take, under model_dir/hub
    # Cores a CPU node gives each engine, bound to it alone while enough are free (the least
    # used otherwise); 0: vLLM binds each engine by itself, every one to the same cores.
    cpu_cores_per_engine: int = 0
    engine_log_kept_days: float = 7.0  # a stopped replica's engine log, on this host

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "AgentConfig":
        """The configuration the variables of `environ` give (KVRUN_CONTROL_PLANE_URL,
        KVRUN_JOIN_TOKEN, KVRUN_NODE_ADDRESS, KVRUN_STATE_DIR, KVRUN_MODEL_DIR,
        KVRUN_ENGINE_LOG_DIR, KVRUN_HUB_URL, KVRUN_MODEL_CACHE_GIB,
        KVRUN_NODE_CPU_CORES_PER_ENGINE, KVRUN_ENGINE_LOG_KEPT_DAYS), the defaults for the
        rest. Raises ValueError for a number that is not one."""
        state_dir = Path(environ.get("KVRUN_STATE_DIR", cls.state_dir))
        return cls(
            control_plane_url=environ.get("KVRUN_CONTROL_PLANE_URL", cls.control_plane_url),
            join_token=environ.get("KVRUN_JOIN_TOKEN", ""),
            address=environ.get("KVRUN_NODE_ADDRESS", cls.address),
            state_dir=state_dir,
            model_dir=Path(environ.get("KVRUN_MODEL_DIR", state_dir / "models")),
            engine_log_dir=Path(environ.get("KVRUN_ENGINE_LOG_DIR", state_dir / "engines")),
            hub_url=environ.get("KVRUN_HUB_URL", cls.hub_url).rstrip("/"),
            model_cache_gib=int(environ.get("KVRUN_MODEL_CACHE_GIB", cls.model_cache_gib)),
            cpu_cores_per_engine=int(environ.get("KVRUN_NODE_CPU_CORES_PER_ENGINE",
                                                 cls.cpu_cores_per_engine)),
            engine_log_kept_days=float(environ.get("KVRUN_ENGINE_LOG_KEPT_DAYS",
                                                   cls.engine_log_kept_days)),
        )

    def credential_file(self, name: str) -> Path:
        """Where the agent of node `name` keeps its credential (readable by its user alone)."""
        return self.state_dir / "nodes" / name / "credential"

    def owner(self, name: str) -> str:
        """The marker of the engines of node `name`'s agent (engine.processes.owner_of)."""
        return processes.owner_of(name, self.state_dir)

    def log_path(self, replica_id: UUID | str) -> Path:
        return self.engine_log_dir / f"{replica_id}.log"

    @property
    def kv_root(self) -> Path:
        return self.state_dir / "kv"

    def kv_dir(self, replica_id: UUID | str) -> Path:
        """The replica's KV tier on disk and its config: deleted when the replica stops or
        fails, so that nothing of a tenant's cache outlives its engine."""
        return self.kv_root / str(replica_id)

    @property
    def compile_cache_root(self) -> Path:
        return self.state_dir / "compile-cache"

    def compile_cache_dir(self, organization_id: UUID | str) -> Path:
        """The compile caches of an organisation's engines on this node: shared by its own
        engines only (an engine could plant code in them)."""
        return self.compile_cache_root / str(organization_id)


@dataclass(frozen=True)
class Timings:
    """What the control plane tells its agents when they register (fleet.selectors)."""

    heartbeat_seconds: float = 5.0
    scrape_seconds: float = 5.0  # how often the agent reads its engines' /metrics
    start_timeout_seconds: float = 600.0  # for an engine to serve, before it has failed
    stop_grace_seconds: float = 15.0  # from SIGTERM to SIGKILL
    # Before an engine is stopped: how long its requests in flight may take to finish, and
    # how long gateways keep routing to a replica after it left `ready`.
    drain_seconds: float = 10.0
    route_cache_seconds: float = 2.0
