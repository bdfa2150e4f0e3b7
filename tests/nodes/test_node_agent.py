import json
import os
import shutil
from pathlib import Path

import pytest

from endpoints.dispatch import node_work_channel
from endpoints.models import Node, NodeState
from endpoints.services import CATALOG_DIR, do_load_catalogs
from endpoints.tasks import mark_lost_nodes
from engine.supervisor import engine_environment
from kvrun.common.redis import redis_client
from nodes.config import VARIABLES, AgentConfig
from tests.helpers import NODE_LOST_AFTER_SECONDS, start_agent, wait_until


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_node_agent_given_two_values_enrols_heartbeats_and_is_lost_when_killed(
    celery_worker: object, web: str, tmp_path: Path
) -> None:
    do_load_catalogs()
    agent = start_agent("test-node-a", tmp_path, web=web)
    try:
        # Its environment: the control plane's URL and its join token, its own settings and
        # its host's; nothing of the control plane's.
        environment = dict(entry.split("=", 1) for entry in Path(
            f"/proc/{agent.pid}/environ").read_text().split("\0") if entry)
        assert environment["KVRUN_CONTROL_PLANE_URL"] == web
        assert environment["KVRUN_JOIN_TOKEN"].startswith("kvj_")
        assert not {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "KVRUN_KEY_PEPPER",
                    "KVRUN_SEALING_KEY", "DJANGO_SETTINGS_MODULE"} & set(environment)
        assert set(environment) - VARIABLES <= set(engine_environment(os.environ, {})) | {
            "HOME"}
        assert wait_until(lambda: Node.objects.filter(name="test-node-a").exists(), timeout=60)
        first_beat = Node.objects.get(name="test-node-a").last_heartbeat_at
        assert wait_until(
            lambda: Node.objects.get(name="test-node-a").last_heartbeat_at > first_beat, timeout=10
        )
        node = Node.objects.get(name="test-node-a")
        # Its long poll of the node's work waits, where a change wakes it.
        assert wait_until(lambda: redis_client().pubsub_numsub(
            node_work_channel(node.id))[0][1] == 1, timeout=30), "the agent follows no work"
        assert (node.state, node.gpu_type.slug, node.devices) == (NodeState.ONLINE, "cpu", [])
        assert node.cpu_count >= 1 and node.memory_bytes > 2**30
        assert node.disk_bytes == shutil.disk_usage(AgentConfig.from_environ().state_dir).total
        # Its vLLM build, read from vLLM's own registry once it is up: what models it runs.
        assert wait_until(lambda: Node.objects.get(name="test-node-a").architectures, 120)
        node = Node.objects.get(name="test-node-a")
        assert node.vllm_version == "0.32.0" and "LlamaForCausalLM" in node.architectures
        # And the parsers it offers: every one the catalog names among them, or engines of
        # that model would not start.
        catalog = json.loads((CATALOG_DIR / "models.json").read_text())
        assert {m["tool_call_parser"] for m in catalog} - {""} <= set(node.tool_parsers)
        assert {m["reasoning_parser"] for m in catalog} - {""} <= set(node.reasoning_parsers)
        assert {"hermes", "llama3_json", "mistral"} <= set(node.tool_parsers)
        assert node.model_cache_bytes == AgentConfig.model_cache_gib * 2**30
    finally:
        agent.kill()
        agent.wait()

    def lost() -> bool:
        mark_lost_nodes.delay()
        return Node.objects.get(name="test-node-a").state == NodeState.LOST

    assert wait_until(lost, timeout=NODE_LOST_AFTER_SECONDS + 20, interval=1.0)
