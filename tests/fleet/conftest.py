import pytest

from endpoints.services import do_load_catalogs
from tests.fleet.helpers import enrolled


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


@pytest.fixture
def credential() -> str:
    """The credential of gpu-1, enrolled through the channel."""
    return enrolled("gpu-1")
