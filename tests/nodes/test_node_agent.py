from pathlib import Path

import pytest
from django.conf import settings

from endpoints.models import Node, NodeState
from endpoints.services import do_load_catalogs
from endpoints.tasks import mark_lost_nodes
from kvrun.celery import app
from tests.helpers import NODE_LOST_AFTER_SECONDS, start_agent, wait_until


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_node_agent_registers_heartbeats_and_is_lost_when_killed(
    celery_worker: object, tmp_path: Path
) -> None:
    do_load_catalogs()
    agent = start_agent("test-node-a", tmp_path)
    try:
        assert wait_until(lambda: Node.objects.filter(name="test-node-a").exists(), timeout=60)
        first_beat = Node.objects.get(name="test-node-a").last_heartbeat_at
        assert wait_until(
            lambda: Node.objects.get(name="test-node-a").last_heartbeat_at > first_beat, timeout=10
        )
        assert wait_until(
            lambda: app.control.ping(destination=["node@test-node-a"], timeout=1.0), timeout=30
        ), "the node agent does not serve its queue"
        node = Node.objects.get(name="test-node-a")
        assert (node.state, node.gpu_type.slug, node.devices) == (NodeState.ONLINE, "cpu", [])
        assert node.cpu_count >= 1 and node.memory_bytes > 2**30
        # Its vLLM build, read from vLLM's own registry once it is up: what models it runs.
        assert wait_until(lambda: Node.objects.get(name="test-node-a").architectures, 120)
        node = Node.objects.get(name="test-node-a")
        assert node.vllm_version == "0.32.0" and "LlamaForCausalLM" in node.architectures
        assert node.model_cache_bytes == settings.KVRUN_MODEL_CACHE_GIB * 2**30
    finally:
        agent.kill()
        agent.wait()

    def lost() -> bool:
        mark_lost_nodes.delay()
        return Node.objects.get(name="test-node-a").state == NodeState.LOST

    assert wait_until(lost, timeout=NODE_LOST_AFTER_SECONDS + 20, interval=1.0)
