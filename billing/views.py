"""Stripe's webhook: the raw body verified against its signature, nothing else trusted."""

from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from billing.payments import (
    InvalidWebhook,
    StripeUnavailable,
    do_receive_webhook,
    receives_webhooks,
)


@csrf_exempt  # Stripe signs the body instead
def stripe_webhook(request: HttpRequest) -> HttpResponse:
    if not receives_webhooks():  # no route to find, whatever the method
        raise Http404("No Stripe webhook: this deployment takes no payments.")
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    try:
        stored = do_receive_webhook(payload=request.body,
                                    signature=request.headers.get("Stripe-Signature", ""))
    except InvalidWebhook as exc:
        return JsonResponse({"error": f"Not a valid Stripe delivery: {exc}"}, status=400)
    except StripeUnavailable as exc:  # nothing was stored: Stripe delivers it again
        return JsonResponse({"error": f"Stripe could not be asked about it: {exc}"},
                            status=503)
    return JsonResponse({"received": True, "duplicate": stored is None})
