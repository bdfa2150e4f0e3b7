import pytest

from endpoints.services import do_load_catalogs


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()
