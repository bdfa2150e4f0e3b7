"""Stripe's webhook: the raw body verified against its signature, nothing else trusted."""

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from billing.payments import (
    InvalidWebhook,
    StripeUnavailable,
    do_receive_webhook,
    receives_webhooks,
)


@csrf_exempt  # Stripe signs the body instead
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    if not receives_webhooks():
        return JsonResponse({"error": "This deployment takes no payments: there is no "
                                      "Stripe webhook here."}, status=404)
    try:
        stored = do_receive_webhook(payload=request.body,
                                    signature=request.headers.get("Stripe-Signature", ""))
    except InvalidWebhook as exc:
        return JsonResponse({"error": f"Not a valid Stripe delivery: {exc}"}, status=400)
    except StripeUnavailable as exc:  # nothing was stored: Stripe delivers it again
        return JsonResponse({"error": f"Stripe could not be asked about it: {exc}"},
                            status=503)
    return JsonResponse({"received": True, "duplicate": stored is None})
