"""Account pages: sign-up, sign-in and out, the password, failed sign-ins."""

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client

from accounts.models import Membership, Role
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db


def test_it_signs_up_and_lands_on_the_dashboard(client: Client) -> None:
    response = client.post("/signup/", {"email": "grace@example.com", "password": PASSWORD,
                                        "organization_name": "Compilers"}, follow=True)

    assert response.status_code == 200
    assert b"Compilers" in response.content
    assert Membership.objects.get(user__email="grace@example.com").role == Role.OWNER


def test_it_shows_field_errors_and_writes_nothing(client: Client) -> None:
    response = client.post("/signup/", {"email": "nope", "password": "short"})

    assert response.status_code == 400
    assert b"valid email" in response.content
    assert b"too short" in response.content
    assert not get_user_model().objects.exists()


def test_sign_in_sign_out_and_change_password(client: Client) -> None:
    user = UserFactory(email="lin@example.com")

    assert client.post("/login/", {"username": "lin@example.com", "password": PASSWORD}
                       ).status_code == 302
    assert client.get("/", follow=True).context["user"] == user
    changed = client.post("/password/", {"old_password": PASSWORD,
                                         "new_password1": "a much better passphrase",
                                         "new_password2": "a much better passphrase"})
    assert changed.status_code == 302
    user.refresh_from_db()
    assert user.check_password("a much better passphrase")
    assert user.password.startswith("argon2$")
    client.post("/logout/")
    assert client.get("/").status_code == 302


def test_failed_logins_lock_the_account(client: Client, settings: object) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    UserFactory(email="target@example.com")
    for _ in range(3):
        client.post("/login/", {"username": "target@example.com", "password": "wrong guess"})

    locked = client.post("/login/", {"username": "target@example.com", "password": PASSWORD})

    assert locked.status_code == 429
    assert b"Too many failed sign-in attempts" in locked.content


def test_failed_logins_lock_the_account_only_for_the_address_they_came_from(
        settings: object) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    UserFactory(email="innocent@example.com")
    UserFactory(email="attacker@example.com")
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    for _ in range(3):
        attacker.post("/login/", {"username": "innocent@example.com", "password": "wrong"})

    locked = attacker.post("/login/", {"username": "innocent@example.com", "password": PASSWORD})
    owner = Client(REMOTE_ADDR="198.51.100.7").post(
        "/login/", {"username": "innocent@example.com", "password": PASSWORD})
    own_account = attacker.post("/login/", {"username": "attacker@example.com",
                                            "password": PASSWORD})

    assert locked.status_code == 429
    assert owner.status_code == 302
    assert own_account.status_code == 302


def test_behind_a_trusted_proxy_lockouts_key_on_the_forwarded_client(settings: object) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    settings.KVRUN_TRUSTED_PROXIES = 1
    UserFactory(email="innocent@example.com")
    proxy = {"REMOTE_ADDR": "10.1.1.1"}
    attacker = Client(HTTP_X_FORWARDED_FOR="203.0.113.9", **proxy)
    for n in range(3):  # a spoofed address on the left changes nothing
        attacker.post("/login/", {"username": "innocent@example.com", "password": "wrong"},
                      HTTP_X_FORWARDED_FOR=f"192.0.2.{n}, 203.0.113.9")

    locked = attacker.post("/login/", {"username": "innocent@example.com", "password": PASSWORD})
    owner = Client(HTTP_X_FORWARDED_FOR="198.51.100.7", **proxy).post(
        "/login/", {"username": "innocent@example.com", "password": PASSWORD})

    assert locked.status_code == 429
    assert owner.status_code == 302


def test_a_forgotten_password_is_reset_through_the_mailed_link(client: Client) -> None:
    user = UserFactory(email="ada@example.com")

    sent = client.post("/password/reset/", {"email": "ADA@example.com"})
    link = next(line for line in mail.outbox[0].body.splitlines() if "/password/reset/" in line)
    form = client.get("/" + link.split("://", 1)[1].split("/", 1)[1], follow=True)
    done = client.post(form.redirect_chain[-1][0], {"new_password1": "a fresh passphrase 9",
                                                    "new_password2": "a fresh passphrase 9"})

    assert sent.status_code == 302
    assert mail.outbox[0].to == ["ada@example.com"]
    assert done.status_code == 302
    user.refresh_from_db()
    assert user.check_password("a fresh passphrase 9")


def test_a_reset_for_an_unknown_email_sends_nothing_and_says_the_same(client: Client) -> None:
    response = client.post("/password/reset/", {"email": "nobody@example.com"}, follow=True)

    assert response.status_code == 200
    assert b"Check your email" in response.content
    assert mail.outbox == []


def test_reset_requests_are_limited_per_client_address(client: Client) -> None:
    UserFactory(email="ada@example.com")

    answers = [client.post("/password/reset/", {"email": "ada@example.com"}).status_code
               for _ in range(6)]

    assert answers == [302] * 5 + [429]
    assert len(mail.outbox) == 5


def test_strangers_cannot_keep_a_person_s_reset_from_them_or_flood_their_inbox() -> None:
    UserFactory(email="ada@example.com")

    def ask(address: str, email: str = "ada@example.com") -> int:
        return Client(REMOTE_ADDR=address).post("/password/reset/", {"email": email}).status_code

    # Strangers from three addresses ask fifteen times: each is answered as anyone is.
    strangers = [ask(f"198.51.100.{n}") for n in range(3) for _ in range(5)]
    ada = ask("203.0.113.9")  # Ada's own request still reaches her

    assert strangers == [302] * 15 and ada == 302
    assert len(mail.outbox) == 16
    # Past the mails an address may be sent in an hour, nothing more is sent, and the answer
    # is the same: it tells nothing of the account or of the count.
    later = [ask(f"192.0.2.{n}") for n in range(5)]
    unknown = ask("192.0.2.99", "nobody@example.com")
    assert later == [302] * 5 and unknown == 302
    assert len(mail.outbox) == 20


def test_reset_mail_is_limited_per_client_behind_a_trusted_proxy(settings: object) -> None:
    settings.KVRUN_TRUSTED_PROXIES = 1
    for n in range(5):
        UserFactory(email=f"user{n}@example.com")
    proxy = {"REMOTE_ADDR": "10.1.1.1"}
    client = Client(HTTP_X_FORWARDED_FOR="203.0.113.9", **proxy)
    for n in range(5):
        client.post("/password/reset/", {"email": f"user{n}@example.com"})

    spent = client.post("/password/reset/", {"email": "user0@example.com"})
    other = Client(HTTP_X_FORWARDED_FOR="198.51.100.7", **proxy).post(
        "/password/reset/", {"email": "user1@example.com"})

    assert spent.status_code == 429
    assert other.status_code == 302


def test_dashboard_sign_ups_are_throttled_per_client_address(client: Client) -> None:
    answers = [client.post("/signup/", {"email": "not an email"}, REMOTE_ADDR="203.0.113.9",
                           HTTP_X_FORWARDED_FOR=f"10.0.0.{n}").status_code for n in range(21)]
    refused = client.post("/signup/", {"email": "ada@example.com", "password": PASSWORD,
                                       "organization_name": "Ada"}, REMOTE_ADDR="203.0.113.9")

    assert answers == [400] * 20 + [429]
    assert refused.status_code == 429
    assert b"Too many sign-ups from your address" in refused.content
    assert not get_user_model().objects.exists()


def test_sign_up_goes_on_to_where_sign_in_was_asked_for(client: Client) -> None:
    body = {"email": "new@example.com", "password": PASSWORD, "organization_name": "New"}

    page = client.get("/signup/?next=/endpoints/new/")
    ours = client.post("/signup/", {**body, "next": "/endpoints/new/"})
    client.post("/logout/")
    theirs = Client().post("/signup/", {**body, "email": "other@example.com",
                                        "next": "https://evil.example/"})

    assert b'name="next" value="/endpoints/new/"' in page.content
    assert ours["Location"] == "/endpoints/new/"
    assert theirs["Location"] == "/"
