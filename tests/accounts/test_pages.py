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


def test_failed_logins_lock_the_address_across_accounts(settings: object) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    UserFactory(email="innocent@example.com")
    client = Client(REMOTE_ADDR="203.0.113.9")
    for n in range(3):
        client.post("/login/", {"username": f"guess{n}@example.com", "password": "wrong guess"})

    locked = client.post("/login/", {"username": "innocent@example.com", "password": PASSWORD})
    elsewhere = Client(REMOTE_ADDR="198.51.100.7").post(
        "/login/", {"username": "innocent@example.com", "password": PASSWORD})

    assert locked.status_code == 429
    assert elsewhere.status_code == 302


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


def test_reset_mail_is_limited_per_address(client: Client) -> None:
    UserFactory(email="ada@example.com")

    answers = [client.post("/password/reset/", {"email": "ada@example.com"}).status_code
               for _ in range(6)]

    assert answers == [302] * 5 + [429]
    assert len(mail.outbox) == 5


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
