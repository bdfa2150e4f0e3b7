"""A node agent in this process, reaching the control plane of this process (Django's own
request handler, in the test's database) through the real node channel."""

from dataclasses import replace
from pathlib import Path

import pytest

from endpoints.models import Node
from nodes import agent
from nodes.channel import NodeChannel
from nodes.config import AgentConfig, Timings
from tests.nodes.helpers import channel_of


@pytest.fixture
def channel(cpu_node: Node, tmp_path: Path) -> NodeChannel:
    return channel_of(cpu_node, tmp_path / "cpu-1")


@pytest.fixture
def node_agent(cpu_node: Node, channel: NodeChannel, tmp_path: Path) -> agent.NodeAgent:
    """A node agent of its own for each test, as `python -m nodes` builds one, keeping its
    state and engine logs in the test's folder (weights where the suite's are)."""
    config = replace(AgentConfig.from_environ(), state_dir=tmp_path / "state",
                     engine_log_dir=tmp_path / "engines")
    return agent.NodeAgent(name=cpu_node.name, config=config, channel=channel,
                           timings=Timings())
