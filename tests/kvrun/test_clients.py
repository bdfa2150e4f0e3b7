import pytest
from django.test import RequestFactory

from kvrun.common.clients import client_address


@pytest.mark.parametrize(
    ("proxies", "forwarded", "expected"),
    [
        (0, "", "10.1.1.1"),
        (0, "203.0.113.9", "10.1.1.1"),  # no proxy is trusted: the header is the client's
        (1, "203.0.113.9", "203.0.113.9"),
        (1, "192.0.2.66, 203.0.113.9", "203.0.113.9"),  # the left part is written by anyone
        (2, "192.0.2.66, 203.0.113.9, 10.2.2.2", "203.0.113.9"),
        (2, "203.0.113.9", "10.1.1.1"),  # did not come through both proxies
    ],
)
def test_it_takes_the_address_the_trusted_proxies_saw(settings: object, proxies: int,
                                                     forwarded: str, expected: str) -> None:
    settings.KVRUN_TRUSTED_PROXIES = proxies
    request = RequestFactory().get("/", REMOTE_ADDR="10.1.1.1", HTTP_X_FORWARDED_FOR=forwarded)

    assert client_address(request) == expected
