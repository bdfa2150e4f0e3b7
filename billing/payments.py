"""Stripe: the one module that imports it.

An organisation is a Stripe customer. A finalised invoice is pushed as one invoice item per
line and a Stripe invoice charged to the customer's default payment method. Every object
kvrun creates carries its kvrun id in its metadata and an idempotency key derived from it, and
a push looks for what an earlier, interrupted push created before creating anything: a retried
push never duplicates an item or an invoice, on Stripe or on a stand-in that ignores
idempotency keys.

Webhooks are taken only where payments are configured, verified on the raw body, stored once
per event id (kept KVRUN_STRIPE_EVENT_KEPT_DAYS), and handled by re-reading the invoice or the
subscription from Stripe, so that events arriving twice, out of order or forged with a
leaked secret end in the state Stripe holds.
"""

import logging
from datetime import datetime, timedelta

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import Organization
from billing.budgets import do_refresh_hold
from billing.models import BillingAccount, Invoice, PaymentStatus, StripeEvent
from billing.money import usd

logger = logging.getLogger(__name__)

SIGNATURE_TOLERANCE_SECONDS = 300
# Every customer subscribes to it; kvrun's own invoices are billed within the subscription.
USAGE_PLAN = "kvrun-usage"
HANDLED = frozenset({"invoice.paid", "invoice.payment_succeeded", "invoice.payment_failed",
                     "invoice.created", "invoice.finalized",
                     "customer.subscription.deleted"})


class InvalidWebhook(Exception):
    """A delivery whose payload or signature does not check out."""


class StripeUnavailable(Exception):
    """Stripe could not be reached or refused a call; the push is for a later retry."""


def configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY)


def receives_webhooks() -> bool:
    """Whether Stripe's deliveries are taken: with its key and the webhook's secret both
    set. `manage.py check --deploy` refuses a deployment with one of them alone."""
    return bool(settings.STRIPE_SECRET_KEY and settings.STRIPE_WEBHOOK_SECRET)


def _client() -> stripe.StripeClient:
    if settings.STRIPE_API_BASE:  # a stand-in (localstripe)
        return stripe.StripeClient(settings.STRIPE_SECRET_KEY, max_network_retries=2,
                                   base_addresses={"api": settings.STRIPE_API_BASE})
    return stripe.StripeClient(settings.STRIPE_SECRET_KEY, max_network_retries=2)


def do_ensure_customer(*, organization: Organization) -> BillingAccount:
    """The organisation's billing account with its Stripe customer and its subscription to
    kvrun's usage plan ($0 a month: kvrun's invoices carry the charges), each created once."""
    account, _ = BillingAccount.objects.get_or_create(organization=organization)
    if account.stripe_subscription_id:
        return account
    client = _client()
    tag = {"kvrun_organization": str(organization.id)}
    if not account.stripe_customer_id:
        existing = [customer for customer in client.v1.customers.list(
            params={"limit": 100}).auto_paging_iter() if _metadata(customer) == tag]
        customer = existing[0] if existing else client.v1.customers.create(
            params={"name": organization.name, "metadata": tag},
            options={"idempotency_key": f"kvrun-customer-{organization.id}"})
        BillingAccount.objects.filter(id=account.id).update(stripe_customer_id=customer.id)
        account.refresh_from_db()
    plan = _usage_plan(client)
    subscriptions = list(client.v1.subscriptions.list(
        params={"customer": account.stripe_customer_id, "status": "all"}))
    live = [subscription for subscription in subscriptions if subscription.status == "active"]
    # Keyed by how many it had: after a cancellation, the next one is a new subscription.
    subscription = live[0] if live else client.v1.subscriptions.create(
        params={"customer": account.stripe_customer_id, "items": [{"plan": plan}],
                "metadata": tag},
        options={"idempotency_key": f"kvrun-subscription-{organization.id}-"
                                    f"{len(subscriptions)}"})
    BillingAccount.objects.filter(id=account.id).update(stripe_subscription_id=subscription.id)
    account.refresh_from_db()
    return account


def _usage_plan(client: stripe.StripeClient) -> str:
    try:
        return client.v1.plans.retrieve(USAGE_PLAN).id
    except stripe.InvalidRequestError:
        return client.v1.plans.create(params={
            "id": USAGE_PLAN, "amount": 0, "currency": "usd", "interval": "month",
            "product": {"name": "kvrun dedicated endpoints"}}).id


def do_attach_card(*, organization: Organization, card: dict[str, object]) -> BillingAccount:
    """Make a card the customer's default payment method (tests, against a Stripe stand-in;
    in production a card is added through Checkout, checkout_url)."""
    account = do_ensure_customer(organization=organization)
    client = _client()
    method = client.v1.payment_methods.create(
        params={"type": "card", "card": card})  # type: ignore[arg-type]  # a test card
    client.v1.payment_methods.attach(method.id, params={"customer": account.stripe_customer_id})
    _use_payment_method(account, method)
    return account


def checkout_url(*, organization: Organization, return_url: str) -> str:
    """A Stripe Checkout page (setup mode) where the customer adds a card. Stripe attaches it
    to the customer; set it as the default for invoices in Stripe's customer settings
    ("Use the most recent payment method"). Raises StripeUnavailable."""
    try:
        account = do_ensure_customer(organization=organization)
        # payment_method_types is a parameter of Stripe's API that its typed params lack.
        session = _client().v1.checkout.sessions.create(params={  # type: ignore[arg-type]
            "mode": "setup", "customer": account.stripe_customer_id, "currency": "usd",
            "payment_method_types": ["card"], "success_url": return_url,
            "cancel_url": return_url})
    except stripe.StripeError as exc:
        raise StripeUnavailable(str(exc)) from exc
    if session.url is None:  # only an embedded session has none
        raise StripeUnavailable("Stripe returned a Checkout session without a page to open.")
    return session.url


def do_push_invoice(*, invoice_id: int) -> Invoice | None:
    """Send a finalised invoice to Stripe and charge it, after any older invoice of its
    organisation still unsent (Stripe bills every pending item of a customer at once, so
    they must go in order); safe to run any number of times. Returns None when the invoice
    is gone or Stripe is not configured; raises StripeUnavailable for a later retry."""
    if not configured():
        return None
    try:
        return _push(invoice_id)
    except stripe.StripeError as exc:
        raise StripeUnavailable(str(exc)) from exc


def _push(invoice_id: int) -> Invoice | None:
    invoice = Invoice.objects.select_related("organization").filter(id=invoice_id).first()
    if invoice is None:
        return None
    account = do_ensure_customer(organization=invoice.organization)
    client = _client()
    with transaction.atomic():
        # One push per organisation at a time.
        BillingAccount.objects.select_for_update().filter(id=account.id).first()
        for older in (Invoice.objects.filter(organization_id=invoice.organization_id,
                                             id__lte=invoice_id)
                      .filter(Q(stripe_invoice_id="") | Q(payment_status=PaymentStatus.OPEN))
                      .order_by("id")):
            _push_one(client, account, older)
    return Invoice.objects.get(id=invoice_id)


def _push_one(client: stripe.StripeClient, account: BillingAccount, invoice: Invoice) -> None:
    """Make the Stripe invoice, unless an earlier push did, and charge it if it is unpaid."""
    customer = account.stripe_customer_id
    stripe_invoice = (client.v1.invoices.retrieve(invoice.stripe_invoice_id)
                      if invoice.stripe_invoice_id else _find_invoice(client, customer, invoice))
    if stripe_invoice is None:
        made = {_metadata(item).get("kvrun_line") for item in client.v1.invoice_items.list(
            params={"customer": customer, "limit": 100}).auto_paging_iter()}
        for line in invoice.lines.all():
            if str(line.id) in made:
                continue
            client.v1.invoice_items.create(params={
                "customer": customer, "amount": line.amount_cents,
                "currency": invoice.currency, "description": line.description,
                "metadata": {"kvrun_line": str(line.id), "kvrun_invoice": str(invoice.id)},
            }, options={"idempotency_key": f"kvrun-line-{line.id}"})
        stripe_invoice = client.v1.invoices.create(params={
            "customer": customer,  # charged automatically, Stripe's default
            "subscription": account.stripe_subscription_id,
            "pending_invoice_items_behavior": "include",
            "description": f"kvrun {invoice.number}",
            "metadata": {"kvrun_invoice": str(invoice.id), "kvrun_number": invoice.number},
        }, options={"idempotency_key": f"kvrun-invoice-{invoice.id}"})
    Invoice.objects.filter(id=invoice.id, payment_status=PaymentStatus.UNSENT).update(
        payment_status=PaymentStatus.OPEN)
    Invoice.objects.filter(id=invoice.id).update(stripe_invoice_id=stripe_invoice.id)
    if stripe_invoice.status in ("draft", "open"):
        try:
            client.v1.invoices.pay(stripe_invoice.id)
        except stripe.CardError as exc:  # declined: Stripe's invoice.payment_failed says so
            logger.warning("the card for Stripe invoice %s was declined: %s",
                           stripe_invoice.id, exc)


def do_receive_webhook(*, payload: bytes, signature: str) -> StripeEvent | None:
    """Verify a delivery, store it once, handle it. Raises InvalidWebhook, changing nothing,
    for a bad payload or signature, and StripeUnavailable when Stripe cannot be asked about
    it (nothing stored: Stripe delivers it again); returns None for an event already
    received."""
    try:
        event = stripe.Webhook.construct_event(payload, signature,
                                               settings.STRIPE_WEBHOOK_SECRET,
                                               tolerance=SIGNATURE_TOLERANCE_SECONDS)
    except (ValueError, stripe.SignatureVerificationError) as exc:
        raise InvalidWebhook(str(exc)) from exc
    # Stored and handled in one transaction: a delivery whose handling fails leaves nothing,
    # and Stripe's retry of it is handled afresh.
    try:
        with transaction.atomic():
            stored = StripeEvent.objects.create(stripe_id=event.id, type=event.type,
                                                payload=event.to_dict())
            stored.outcome = _handle(event) if event.type in HANDLED else "ignored"
            stored.handled_at = timezone.now()
            stored.save(update_fields=["outcome", "handled_at"])
    except IntegrityError:
        return None
    except stripe.StripeError as exc:
        raise StripeUnavailable(str(exc)) from exc
    return stored


def _handle(event: stripe.Event) -> str:
    data = event.data.object
    if event.type == "customer.subscription.deleted":
        # The subscription as Stripe holds it now decides, not the payload, and only the
        # one kvrun made for an account with a customer of its own.
        try:
            subscription = _client().v1.subscriptions.retrieve(data.id)
        except stripe.InvalidRequestError:  # an id Stripe does not know: forged, or another's
            return f"no subscription {data.id} on Stripe: nothing done"
        if subscription.status != "canceled":
            return (f"subscription {subscription.id} is {subscription.status} on Stripe: "
                    "nothing done")
        account = (BillingAccount.objects.exclude(stripe_customer_id="")
                   .filter(stripe_customer_id=subscription.customer,
                           stripe_subscription_id=subscription.id).first())
        if account is None:
            return "no organisation has this subscription"
        # Forgotten, so that invoices pushed later (once paid, or once an operator clears
        # the delinquency) go to a new subscription rather than to the cancelled one.
        BillingAccount.objects.filter(id=account.id).update(stripe_subscription_id="")
        _mark_delinquent(account, "Its Stripe subscription was cancelled")
        do_refresh_hold(organization=account.organization)
        return "organisation marked unpaid"
    # Any invoice event: the invoice as Stripe holds it now decides, whatever the order.
    current = _client().v1.invoices.retrieve(data.id)
    invoice = _ours(current)
    if invoice is None:
        return "not a kvrun invoice"
    account = BillingAccount.objects.get(organization_id=invoice.organization_id)
    if current.status == "paid":
        Invoice.objects.filter(id=invoice.id).update(stripe_invoice_id=current.id,
                                                     payment_status=PaymentStatus.PAID)
        if not Invoice.objects.filter(organization_id=invoice.organization_id,
                                      payment_status=PaymentStatus.FAILED).exists():
            BillingAccount.objects.filter(id=account.id).update(delinquent_since=None,
                                                                delinquent_reason="")
        do_refresh_hold(organization=invoice.organization)
        return f"invoice {invoice.number} paid"
    if event.type == "invoice.payment_failed":
        Invoice.objects.filter(id=invoice.id).update(stripe_invoice_id=current.id,
                                                     payment_status=PaymentStatus.FAILED)
        _mark_delinquent(account, f"The payment of invoice {invoice.number} "
                                  f"({usd(invoice.total_cents)}) failed")
        do_refresh_hold(organization=invoice.organization)
        return f"invoice {invoice.number} payment failed"
    Invoice.objects.filter(id=invoice.id, stripe_invoice_id="").update(
        stripe_invoice_id=current.id, payment_status=PaymentStatus.OPEN)
    return f"invoice {invoice.number} {current.status}"


def do_prune_stripe_events(*, now: datetime) -> int:
    """Delete the webhook deliveries handled more than KVRUN_STRIPE_EVENT_KEPT_DAYS before
    `now` (Stripe redelivers an event for three days at most, so a pruned id never comes
    back as new). Returns how many."""
    kept_from = now - timedelta(days=settings.KVRUN_STRIPE_EVENT_KEPT_DAYS)
    deleted, _ = StripeEvent.objects.filter(received_at__lt=kept_from,
                                            handled_at__isnull=False).delete()
    return deleted


def do_clear_delinquency(*, account: BillingAccount) -> bool:
    """An operator's pardon: the account is no longer delinquent, and the hold that its
    failed payment put on the organisation is lifted (a budget's stays). Its invoices keep
    their payment status. Returns False, changing nothing, for an account not delinquent."""
    cleared = BillingAccount.objects.filter(id=account.id, delinquent_since__isnull=False
                                            ).update(delinquent_since=None, delinquent_reason="")
    if cleared:
        do_refresh_hold(organization=account.organization)
    return bool(cleared)


def _mark_delinquent(account: BillingAccount, what: str) -> None:
    """Start the grace period, once: a second failure does not restart it."""
    now = timezone.now()
    ends = now + timedelta(seconds=settings.KVRUN_PAYMENT_GRACE_SECONDS)
    reason = (f"{what}. Update the payment method under Usage & billing "
              f"({settings.KVRUN_BASE_URL}/orgs/{account.organization.slug}/billing/): the "
              f"endpoints stop on {ends:%Y-%m-%d %H:%M} UTC if it is still unpaid, and may "
              f"start again once it is paid.")
    BillingAccount.objects.filter(id=account.id, delinquent_since=None).update(
        delinquent_since=now, delinquent_reason=reason)


def _find_invoice(client: stripe.StripeClient, customer: str,
                  invoice: Invoice) -> stripe.Invoice | None:
    """The Stripe invoice an earlier push made of `invoice`: the one with its lines on it."""
    for candidate in client.v1.invoices.list(
            params={"customer": customer, "limit": 100}).auto_paging_iter():
        if any(_metadata(line).get("kvrun_invoice") == str(invoice.id)
               for line in candidate.lines):
            return candidate
    return None


def _ours(stripe_invoice: stripe.Invoice) -> Invoice | None:
    """kvrun's invoice for a Stripe invoice: by the id kvrun stored, else by its metadata or
    its lines' (a webhook can arrive before kvrun has stored the id)."""
    found = Invoice.objects.filter(stripe_invoice_id=stripe_invoice.id).first()
    if found is not None:
        return found
    tags = [_metadata(stripe_invoice), *(_metadata(line) for line in stripe_invoice.lines)]
    ids = {tag["kvrun_invoice"] for tag in tags if tag.get("kvrun_invoice", "").isdigit()}
    return Invoice.objects.filter(id__in=[int(kvrun_id) for kvrun_id in ids]).first()


def _use_payment_method(account: BillingAccount, method: stripe.PaymentMethod) -> None:
    _client().v1.customers.update(account.stripe_customer_id, params={
        "invoice_settings": {"default_payment_method": method.id}})
    card = method.card
    BillingAccount.objects.filter(id=account.id).update(
        payment_method=f"{getattr(card, 'brand', 'card')} …{getattr(card, 'last4', '')}")


def _metadata(stripe_object: stripe.StripeObject) -> dict[str, str]:
    metadata = getattr(stripe_object, "metadata", None)
    return metadata.to_dict() if metadata else {}

