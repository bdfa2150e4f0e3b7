"""A node agent's process: `python -m nodes --name NAME`. Detects the host's devices, joins
the control plane (nodes.config: its URL, and a join token the first time), then heartbeats,
sends its engines' samples and does the node's work as the channel's long poll gives it,
until SIGTERM or SIGINT, which stop every engine with it.

Pure Python, like the engines it starts: a node holds no database, no Redis and no secret
of the control plane, only its own credential.
"""

import argparse
import logging
import signal
import socket
import sys
import threading
from dataclasses import asdict, replace
from typing import Any

from engine import build, devices
from engine.sizing import CPU, GIB, GPU
from nodes import weights
from nodes.agent import NodeAgent, stop_engines_left_behind
from nodes.channel import ChannelDown, ChannelRefused, NodeChannel, NodeRevoked
from nodes.config import AgentConfig, Timings

logger = logging.getLogger("nodes")

# How long one long poll of the node's work waits for a change, and how long the agent waits
# before asking again after a failed one.
WORK_WAIT_SECONDS = 25.0
WORK_RETRY_SECONDS = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodes", description=__doc__.split("\n\n")[0],
        epilog="Configured by the environment: KVRUN_CONTROL_PLANE_URL and, the first time, "
               "KVRUN_JOIN_TOKEN (docs/operations.md).")
    parser.add_argument("--name", default=socket.gethostname(), help="Node name (unique).")
    parser.add_argument("--address", help="Private address its engines listen on, reachable "
                                          "from the web processes (KVRUN_NODE_ADDRESS).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call to the channel
    config = AgentConfig.from_environ()
    if args.address:
        config = replace(config, address=args.address)
    try:
        return run(args.name, config)
    except AgentRefused as exc:
        logger.error("%s", exc)
        return 1


class AgentRefused(Exception):
    """The control plane would not let the node in; the message says why."""


def run(name: str, config: AgentConfig) -> int:
    # Before the node is online again: none of its devices may be handed out while an
    # engine of the previous run still holds them.
    left = stop_engines_left_behind(config, name=name, grace=Timings.stop_grace_seconds)
    if left:
        logger.info("stopped %d engine(s) left by this node's previous run", left)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    resources = devices.detect(config.state_dir)
    report: dict[str, Any] = {
        "resources": asdict(resources), "address": config.address,
        "model_cache_bytes": config.model_cache_gib * GIB}
    channel = NodeChannel(url=config.control_plane_url,
                          credential_file=config.credential_file(name))
    try:
        joined = channel.join(name=name, join_token=config.join_token, report=report)
    except (NodeRevoked, ChannelRefused, ChannelDown) as exc:
        raise AgentRefused(f"node {name} could not join the control plane at "
                           f"{config.control_plane_url}: {exc}") from exc
    if joined["node"]["name"] != name:
        raise AgentRefused(f"this node's credential is node {joined['node']['name']}'s, "
                           f"not {name}'s")
    told = {key: value for key, value in joined["timings"].items()
            if key in Timings.__dataclass_fields__}  # a newer control plane may tell more
    agent = NodeAgent(name=name, config=config, channel=channel, timings=Timings(**told))
    agent.delete_kv_caches_left_behind()
    weights.report(channel, config)
    # The vLLM build's architectures take seconds to read (once per version): the node takes
    # replicas meanwhile, and adding a model waits for them.
    threading.Thread(target=_read_build, args=(channel, config, resources), daemon=True).start()
    logger.info("node %s: %d GPU(s) (%s), %d CPUs, %.1f GiB; engines on %s", name,
                len(resources.devices), joined["node"]["gpu_type"] or "no catalog match",
                resources.cpu_count, resources.memory_bytes / 2**30, config.address)
    failed = agent.fail_replicas_of_previous_run()
    if failed:
        logger.info("%d replica(s) from this node's previous run marked failed", failed)
    stop = threading.Event()
    threading.Thread(target=_beat, args=(agent, report, stop), daemon=True).start()
    for loop in (_scrape, _follow_work):
        threading.Thread(target=loop, args=(agent, stop), daemon=True).start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        # Within the 10 s the agent's own supervisor gives it: every engine ends with it.
        agent.stop_all_engines()
    return 0


def _read_build(channel: NodeChannel, config: AgentConfig,
                resources: devices.HostResources) -> None:
    try:
        found = build.detect(device=GPU if resources.devices else CPU, cache_dir=config.state_dir)
        channel.record_build(found)
        logger.info("vLLM %s, %d model architectures", found.version or "not installed",
                    len(found.architectures))
    except Exception:  # no architectures: models are not added until it is read
        logger.exception("reading the vLLM build failed")


def _beat(agent: NodeAgent, report: dict[str, Any], stop: threading.Event) -> None:
    # A thread of its own: the heartbeat never waits behind work or an engine's stop.
    while not stop.wait(agent.timings.heartbeat_seconds):
        try:
            if not agent.beat():  # the node has no catalog GPU type yet
                agent.channel.join(name=agent.name, join_token="", report=report)
                agent.beat()
        except NodeRevoked as exc:  # an operator's decision: its engines stop, and so does it
            logger.error("this node was revoked (%s); stopping its engines and the agent", exc)
            stop.set()
            return
        except Exception as exc:  # the control plane away: the next beat tries again
            logger.warning("heartbeat failed (%s); retrying at the next interval", exc)


def _scrape(agent: NodeAgent, stop: threading.Event) -> None:
    # Apart from the heartbeat: a slow engine's /metrics must never delay it.
    while not stop.wait(agent.timings.scrape_seconds):
        try:
            agent.scrape()
        except Exception as exc:  # the control plane away loses one sample
            logger.warning("sending the engines' metrics failed (%s); retrying", exc)


def _follow_work(agent: NodeAgent, stop: threading.Event) -> None:
    # The node's long poll: each answer is its whole work, which the agent acts on.
    seen = ""
    while not stop.is_set():
        try:
            work = agent.channel.work(seen=seen, wait=WORK_WAIT_SECONDS)
        except NodeRevoked as exc:
            logger.error("this node was revoked (%s); stopping its engines and the agent", exc)
            stop.set()
            return
        except Exception as exc:  # the control plane away: ask again shortly
            logger.warning("reading this node's work failed (%s); asking again", exc)
            stop.wait(WORK_RETRY_SECONDS)
            continue
        seen = work["version"]
        agent.take_work(work)
