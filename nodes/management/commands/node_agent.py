import socket
import threading
from typing import Any

from celery.signals import worker_shutting_down
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections

from engine import build, devices
from engine.sizing import CPU, GIB, GPU
from fleet.reports import NodeRevoked, do_record_node_build, do_register_node
from kvrun.celery import app
from nodes import weights
from nodes.agent import (
    NodeAgent,
    do_fail_replicas_of_previous_agent,
    scrape,
    serve,
    stop_engines_left_behind,
)


class Command(BaseCommand):
    help = (
        "Run this host's node agent: detect devices, register the node, heartbeat, "
        "and serve the Celery queue node.<name>."
    )

    def add_arguments(self, parser: object) -> None:
        parser.add_argument("--name", default=socket.gethostname(), help="Node name (unique).")
        parser.add_argument("--concurrency", type=int, default=4)
        parser.add_argument("--address", default=settings.KVRUN_NODE_ADDRESS,
                            help="Private address engines listen on, reachable from the web.")

    def handle(self, *args: object, name: str, concurrency: int, address: str,
               **options: object) -> None:
        # Before the node is online again: none of its devices may be handed out while an
        # engine of the previous run still holds them.
        left = stop_engines_left_behind(name=name)
        if left:
            self.stdout.write(f"stopped {left} engine(s) left by this node's previous run")
        resources = devices.detect()
        registration: dict[str, Any] = {
            "resources": resources, "address": address,
            "model_cache_bytes": settings.KVRUN_MODEL_CACHE_GIB * GIB}
        try:
            node = do_register_node(name=name, **registration)
        except NodeRevoked as exc:
            raise CommandError(f"{exc}; this agent stops") from exc
        weights.report(name)
        # The vLLM build's architectures take seconds to read (once per version): the node
        # takes replicas meanwhile, and adding a model waits for them.
        threading.Thread(target=self._read_build, args=(name, resources, registration),
                         daemon=True).start()
        gpu = node.gpu_type.name if node.gpu_type else "no catalog match"
        self.stdout.write(
            f"node {name}: {len(resources.devices)} GPU(s) ({gpu}), {resources.cpu_count} CPUs, "
            f"{resources.memory_bytes / 2**30:.1f} GiB; engines on {address}; queue {node.queue}"
        )
        failed = do_fail_replicas_of_previous_agent(node=node)
        if failed:
            self.stdout.write(f"{failed} replica(s) from this node's previous run marked failed")
        agent = NodeAgent(name=name)
        serve(agent)
        stop = threading.Event()
        heartbeat = threading.Thread(target=self._beat, args=(agent, registration, stop),
                                     daemon=True)
        heartbeat.start()
        threading.Thread(target=self._scrape, args=(name, stop), daemon=True).start()

        # Celery's warm shutdown waits for running tasks, and a start waits for its engine:
        # stop the engines as the shutdown begins, so the starts end with them.
        def on_shutdown(**kwargs: object) -> None:
            agent.stop_all_engines()

        worker_shutting_down.connect(on_shutdown, weak=False)
        try:
            # Threads, not processes: node tasks wait on engines, they do not compute. Quiet:
            # its own log says what it does, and Celery's banner would bury `make run`'s URLs.
            app.Worker(
                queues=[node.queue], hostname=f"node@{name}", pool="threads",
                concurrency=concurrency, loglevel="INFO", quiet=True,
            ).start()
        finally:
            stop.set()
            agent.stop_all_engines()

    def _read_build(self, name: str, resources: devices.HostResources,
                    registration: dict[str, Any]) -> None:
        try:
            found = build.detect(device=GPU if resources.devices else CPU,
                                 cache_dir=settings.KVRUN_STATE_DIR)
            registration["build"] = found  # a later registration reports it too
            do_record_node_build(name=name, build=found)
            self.stdout.write(f"node {name}: vLLM {found.version or 'not installed'}, "
                              f"{len(found.architectures)} model architectures")
        except Exception as exc:  # no architectures: models are not added until it is read
            self.stderr.write(f"reading the vLLM build failed: {exc}")
        finally:
            close_old_connections()

    def _beat(self, agent: NodeAgent, registration: dict[str, Any],
              stop: threading.Event) -> None:
        # A thread of its own: the heartbeat never waits behind a task or an engine's stop.
        while not stop.wait(settings.KVRUN_NODE_HEARTBEAT_SECONDS):
            try:
                if not agent.beat():  # row removed, or catalog type missing
                    do_register_node(name=agent.name, **registration)
                    agent.beat()
            except NodeRevoked as exc:  # an operator's decision: said once; no beat helps
                self.stderr.write(f"{exc}; its engines are no longer routed to, and it sends "
                                  "no more heartbeats")
                return
            except Exception:  # a database blip must not kill the agent; the next beat retries
                self.stderr.write("heartbeat failed; retrying at the next interval")
            finally:
                close_old_connections()

    def _scrape(self, name: str, stop: threading.Event) -> None:
        # Apart from the heartbeat: a slow engine's /metrics must never delay it.
        while not stop.wait(settings.KVRUN_ENGINE_SCRAPE_SECONDS):
            try:
                scrape(name=name)
            except Exception:  # a database blip loses one sample; the next one comes
                self.stderr.write("reading the engines' metrics failed; retrying")
            finally:
                close_old_connections()
