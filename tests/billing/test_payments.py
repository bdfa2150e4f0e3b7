"""Stripe against localstripe: a finalised invoice pushed once however often the push runs,
and webhooks verified, stored once and handled in any order."""

import json
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import stripe
import time_machine
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.core.checks import run_checks
from django.test import Client

from accounts.models import Organization
from billing.budgets import do_enforce_budgets
from billing.models import BillingAccount, Invoice, PaymentStatus, StripeEvent
from billing.payments import (
    do_attach_card,
    do_clear_delinquency,
    do_ensure_customer,
    do_prune_stripe_events,
    do_push_invoice,
)
from endpoints.models import DesiredState, Endpoint, Node, Replica
from tests.billing.conftest import WEBHOOK_SECRET
from tests.billing.helpers import finalize_at, ready_for
from tests.factories import UserFactory, demo_endpoint
from tests.helpers import wait_until

GOOD_CARD = {"number": "4242424242424242", "exp_month": 12, "exp_year": 2031, "cvc": "123"}
DECLINED_CARD = {"number": "4000000000000341", "exp_month": 12, "exp_year": 2031, "cvc": "123"}
WEBHOOK = "/billing/stripe/webhook"


@pytest.fixture
def invoice(cpu_endpoint: Endpoint, cpu_node: Node, stripe_on: str) -> Invoice:
    """January's invoice, finalised: 10 h ready at $0.40 and its start-up and stop."""
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=10)
    finalize_at(datetime(2026, 2, 1, 2, tzinfo=UTC))
    return Invoice.objects.get()


def stripe_client() -> stripe.StripeClient:
    return stripe.StripeClient(settings.STRIPE_SECRET_KEY,
                               base_addresses={"api": settings.STRIPE_API_BASE})


def on_stripe(organization: Organization) -> tuple[list, list]:
    """The customer's invoices (newest first) and invoice items as Stripe holds them."""
    customer = BillingAccount.objects.get(organization=organization).stripe_customer_id
    return (list(stripe_client().v1.invoices.list(params={"customer": customer})),
            list(stripe_client().v1.invoice_items.list(params={"customer": customer})))


def ours_on_stripe(organization: Organization) -> stripe.Invoice:
    """The Stripe invoice with kvrun's lines (the usage plan makes $0 ones beside it)."""
    invoices, _ = on_stripe(organization)
    [ours] = [stripe_invoice for stripe_invoice in invoices if any(
        line.metadata.to_dict().get("kvrun_invoice") for line in stripe_invoice.lines)]
    return ours


def deliver(web: Client, event_type: str, obj: dict, *, event_id: str | None = None,
            secret: str = WEBHOOK_SECRET) -> object:
    """POST a Stripe event as Stripe does: JSON body, signed with the endpoint's secret."""
    payload = json.dumps({"id": event_id or f"evt_{time.time_ns()}", "object": "event",
                          "type": event_type, "created": int(time.time()),
                          "data": {"object": obj}})
    header = stripe.WebhookSignature.generate_signature_header(payload, secret)
    return web.post(WEBHOOK, payload, content_type="application/json",
                    HTTP_STRIPE_SIGNATURE=header)


def test_a_pushed_invoice_is_one_invoice_and_one_item_a_line_however_often_it_is_pushed(
        invoice: Invoice, org: Organization) -> None:
    do_attach_card(organization=org, card=GOOD_CARD)
    lines = list(invoice.lines.order_by("id"))
    # An earlier push was cut off after its first item.
    customer = do_ensure_customer(organization=org).stripe_customer_id
    stripe_client().v1.invoice_items.create(params={
        "customer": customer, "amount": lines[0].amount_cents, "currency": "usd",
        "description": lines[0].description,
        "metadata": {"kvrun_line": str(lines[0].id), "kvrun_invoice": str(invoice.id)}})

    do_push_invoice(invoice_id=invoice.id)
    # Another whose answer was lost after Stripe made the invoice.
    Invoice.objects.filter(id=invoice.id).update(stripe_invoice_id="")
    do_push_invoice(invoice_id=invoice.id)
    do_push_invoice(invoice_id=invoice.id)

    ours = [ours_on_stripe(org)]  # exactly one
    assert on_stripe(org)[1] == []  # no item left pending
    items = [line for line in ours[0].lines if line.metadata.to_dict().get("kvrun_line")]
    assert sorted(item.metadata.to_dict()["kvrun_line"] for item in items) == sorted(
        str(line.id) for line in lines)
    assert ours[0].total == invoice.total_cents == sum(item.amount for item in items)
    assert ours[0].status == "paid"
    assert Invoice.objects.get(id=invoice.id).stripe_invoice_id == ours[0].id


def test_a_webhook_with_a_bad_signature_is_refused_and_changes_nothing(
        invoice: Invoice, org: Organization, client: Client) -> None:
    do_attach_card(organization=org, card=GOOD_CARD)
    do_push_invoice(invoice_id=invoice.id)
    stripe_invoice = ours_on_stripe(org)

    forged = deliver(client, "invoice.payment_failed", stripe_invoice.to_dict(),
                     secret="whsec_someone_else")
    unsigned = client.post(WEBHOOK, "{}", content_type="application/json")

    assert forged.status_code == 400 and "signature" in forged.json()["error"].lower()
    assert unsigned.status_code == 400
    assert not StripeEvent.objects.exists()
    assert BillingAccount.objects.get(organization=org).delinquent_since is None


def test_the_same_event_twice_has_one_effect_and_paid_before_created_ends_paid(
        invoice: Invoice, org: Organization, client: Client) -> None:
    do_attach_card(organization=org, card=GOOD_CARD)
    do_push_invoice(invoice_id=invoice.id)
    Invoice.objects.filter(id=invoice.id).update(payment_status=PaymentStatus.OPEN)
    stripe_invoice = ours_on_stripe(org).to_dict()

    first = deliver(client, "invoice.paid", stripe_invoice, event_id="evt_paid")
    again = deliver(client, "invoice.paid", stripe_invoice, event_id="evt_paid")
    created = deliver(client, "invoice.created", {**stripe_invoice, "status": "draft"})

    assert (first.status_code, first.json()["duplicate"]) == (200, False)
    assert (again.status_code, again.json()["duplicate"]) == (200, True)
    assert created.status_code == 200
    assert StripeEvent.objects.filter(stripe_id="evt_paid").count() == 1
    assert Invoice.objects.get(id=invoice.id).payment_status == PaymentStatus.PAID
    assert StripeEvent.objects.get(stripe_id="evt_paid").outcome.endswith("paid")


def test_a_failed_payment_stops_the_endpoints_after_the_grace_and_paying_lifts_it(
        invoice: Invoice, org: Organization, client: Client, cpu_endpoint: Endpoint) -> None:
    do_attach_card(organization=org, card=DECLINED_CARD)
    do_push_invoice(invoice_id=invoice.id)
    stripe_invoice = ours_on_stripe(org)
    assert stripe_invoice.status == "open"

    failed = deliver(client, "invoice.payment_failed", stripe_invoice.to_dict())
    deliver(client, "invoice.payment_failed", stripe_invoice.to_dict())  # Stripe retried

    assert failed.status_code == 200
    account = BillingAccount.objects.get(organization=org)
    assert account.delinquent_since is not None
    assert Invoice.objects.get(id=invoice.id).payment_status == PaymentStatus.FAILED
    assert Organization.objects.get(id=org.id).billing_hold == ""  # in its grace period
    with time_machine.travel(account.delinquent_since + timedelta(
            seconds=settings.KVRUN_PAYMENT_GRACE_SECONDS - 60)):
        do_enforce_budgets()
    assert Organization.objects.get(id=org.id).billing_hold == ""
    with time_machine.travel(account.delinquent_since + timedelta(
            seconds=settings.KVRUN_PAYMENT_GRACE_SECONDS + 60)):
        do_enforce_budgets()
    hold = Organization.objects.get(id=org.id).billing_hold
    assert f"The payment of invoice {invoice.number} ($4.00) failed" in hold
    assert Endpoint.objects.get(id=cpu_endpoint.id).desired_state == DesiredState.STOPPED

    do_attach_card(organization=org, card=GOOD_CARD)
    paid = stripe_client().v1.invoices.pay(stripe_invoice.id)
    deliver(client, "invoice.paid", paid.to_dict())

    assert Invoice.objects.get(id=invoice.id).payment_status == PaymentStatus.PAID
    assert BillingAccount.objects.get(organization=org).delinquent_since is None
    assert Organization.objects.get(id=org.id).billing_hold == ""


@pytest.mark.django_db(transaction=True)
def test_stripe_s_own_deliveries_reach_kvrun_and_settle_the_invoice(
        live_server: object, cpu_node: Node, org: Organization, stripe_on: str) -> None:
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    ready_for(endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=10)
    finalize_at(datetime(2026, 2, 1, 2, tzinfo=UTC))
    invoice = Invoice.objects.get()
    httpx.post(f"{stripe_on}/_config/webhooks/kvrun", data={
        "url": f"{live_server.url}{WEBHOOK}", "secret": WEBHOOK_SECRET}).raise_for_status()
    do_attach_card(organization=org, card=GOOD_CARD)

    do_push_invoice(invoice_id=invoice.id)

    # localstripe signs and posts each event a second after it happens.
    assert wait_until(lambda: StripeEvent.objects.filter(
        type="invoice.payment_succeeded", outcome=f"invoice {invoice.number} paid").exists(), 20)
    assert Invoice.objects.get(id=invoice.id).payment_status == PaymentStatus.PAID
    assert StripeEvent.objects.filter(type="invoice.created").exists()


def test_the_billing_page_shows_the_card_and_sends_people_to_stripe_for_a_new_one(
        invoice: Invoice, org: Organization, owner: object, client: Client) -> None:
    client.force_login(owner)
    do_attach_card(organization=org, card=GOOD_CARD)

    page = client.get(f"/orgs/{org.slug}/billing/")
    # The stand-in has no Checkout: what a person sees when Stripe cannot open it.
    checkout = client.post(f"/orgs/{org.slug}/billing/payment-method/", follow=True)

    assert b"visa \xe2\x80\xa64242" in page.content
    assert checkout.status_code == 200
    assert b"Stripe could not open its payment page" in checkout.content


def test_a_delivery_stripe_cannot_be_asked_about_is_stored_only_once_handled(
        invoice: Invoice, org: Organization, client: Client) -> None:
    do_attach_card(organization=org, card=GOOD_CARD)
    unknown = {"id": "in_unknown", "object": "invoice", "status": "paid"}

    failed = deliver(client, "invoice.paid", unknown, event_id="evt_retried")

    assert failed.status_code == 503
    assert not StripeEvent.objects.filter(stripe_id="evt_retried").exists()


@pytest.mark.django_db
def test_without_payments_configured_the_webhook_is_a_404_and_stores_nothing(
        client: Client, settings: object) -> None:
    for key, secret in (("", ""), ("sk_test_kvrun", ""), ("", WEBHOOK_SECRET)):
        settings.STRIPE_SECRET_KEY, settings.STRIPE_WEBHOOK_SECRET = key, secret

        refused = deliver(client, "invoice.paid", {"id": "in_1", "object": "invoice"})

        assert refused.status_code == 404
        assert client.get(WEBHOOK).status_code == 404  # no route, whatever the method
    assert not StripeEvent.objects.exists()


@pytest.mark.parametrize(("key", "secret", "missing"), [
    ("sk_test_kvrun", "", "STRIPE_WEBHOOK_SECRET"), ("", WEBHOOK_SECRET, "STRIPE_SECRET_KEY"),
    ("", "", None), ("sk_test_kvrun", WEBHOOK_SECRET, None)])
def test_check_deploy_refuses_a_half_configured_stripe(settings: object, key: str, secret: str,
                                                       missing: str | None) -> None:
    settings.STRIPE_SECRET_KEY, settings.STRIPE_WEBHOOK_SECRET = key, secret

    found = [message for message in run_checks(include_deployment_checks=True)
             if message.id == "kvrun.billing.E001"]

    if missing is None:
        assert found == []
    else:
        [error] = found
        assert error.is_serious() and f"{missing} is not" in error.msg


def test_a_cancelled_subscription_counts_as_stripe_holds_it_not_as_the_payload_says(
        invoice: Invoice, org: Organization, other_org: Organization, client: Client) -> None:
    account = do_attach_card(organization=org, card=GOOD_CARD)
    # An account made while payments were off: no customer, which must match nothing.
    BillingAccount.objects.create(organization=other_org)
    live = stripe_client().v1.subscriptions.retrieve(account.stripe_subscription_id).to_dict()

    forged = deliver(client, "customer.subscription.deleted", {**live, "status": "canceled"})
    empty = deliver(client, "customer.subscription.deleted", {**live, "customer": ""})

    assert (forged.status_code, empty.status_code) == (200, 200)
    assert sorted(StripeEvent.objects.values_list("outcome", flat=True)) == [
        f"subscription {live['id']} is {live['status']} on Stripe: nothing done"] * 2
    assert not BillingAccount.objects.exclude(delinquent_since=None).exists()

    unknown = deliver(client, "customer.subscription.deleted", {**live, "id": "sub_nobody"})
    assert unknown.status_code == 200  # not a 503: Stripe would retry it for days
    assert StripeEvent.objects.filter(outcome="no subscription sub_nobody on Stripe: "
                                              "nothing done").exists()

    cancelled = stripe_client().v1.subscriptions.cancel(account.stripe_subscription_id)
    delivered = deliver(client, "customer.subscription.deleted", cancelled.to_dict())

    assert delivered.status_code == 200
    after = BillingAccount.objects.get(organization=org)
    assert after.delinquent_since is not None and after.stripe_subscription_id == ""
    assert BillingAccount.objects.get(organization=other_org).delinquent_since is None
    # Cleared by an operator (or paid), the next push subscribes the customer anew.
    do_clear_delinquency(account=after)
    renewed = do_ensure_customer(organization=org)
    assert renewed.stripe_subscription_id not in ("", account.stripe_subscription_id)
    assert stripe_client().v1.subscriptions.retrieve(
        renewed.stripe_subscription_id).status == "active"


def test_check_refuses_a_retention_shorter_than_stripe_s_retries(settings: object) -> None:
    settings.KVRUN_STRIPE_EVENT_KEPT_DAYS = 2

    assert [message.id for message in run_checks() if message.id.startswith("kvrun.")] == [
        "kvrun.billing.E002"]


@pytest.mark.django_db
def test_stored_deliveries_are_pruned_after_their_retention(settings: object) -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    for stripe_id, days, handled in (("evt_old", 91, True), ("evt_kept", 89, True),
                                     ("evt_unhandled", 200, False)):
        event = StripeEvent.objects.create(stripe_id=stripe_id, type="invoice.paid",
                                           payload={}, handled_at=now if handled else None)
        StripeEvent.objects.filter(id=event.id).update(received_at=now - timedelta(days=days))

    assert do_prune_stripe_events(now=now) == 1

    assert sorted(StripeEvent.objects.values_list("stripe_id", flat=True)) == [
        "evt_kept", "evt_unhandled"]


@pytest.mark.django_db
def test_an_operator_clears_a_delinquency_with_a_reason_kept_in_the_history(
        org: Organization, cpu_endpoint: Endpoint) -> None:
    account = BillingAccount.objects.create(
        organization=org, delinquent_since=datetime(2026, 1, 1, tzinfo=UTC),
        delinquent_reason="The payment of invoice KVR-1 failed")
    do_enforce_budgets()
    assert Organization.objects.get(id=org.id).billing_hold  # past its grace: held
    operator = Client()
    operator.force_login(UserFactory(is_staff=True, is_superuser=True))
    page = f"/admin/billing/billingaccount/{account.id}/change/"

    unexplained = operator.post(page, {"clear_delinquency": "on", "reason": " "})
    assert unexplained.status_code == 200
    assert unexplained.context["adminform"].form.errors == {
        "reason": ["Say why: the reason is kept in the history."]}
    assert BillingAccount.objects.get(id=account.id).delinquent_since is not None

    cleared = operator.post(page, {"clear_delinquency": "on", "reason": "paid by wire"})

    assert cleared.status_code == 302
    assert BillingAccount.objects.get(id=account.id).delinquent_since is None
    assert Organization.objects.get(id=org.id).billing_hold == ""
    assert LogEntry.objects.get(object_id=str(account.id)).get_change_message() == (
        "Cleared the delinquency: paid by wire")
    again = operator.post(page, {"clear_delinquency": "on", "reason": "twice"})
    assert again.context["adminform"].form.errors == {
        "clear_delinquency": ["This account is not delinquent."]}
