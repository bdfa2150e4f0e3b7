"""Numbers as people read them: parameters in billions, bytes in GiB, tokens in k, cents in
dollars."""

from django import template

from billing.money import usd
from kvrun.common.units import duration_text

register = template.Library()


@register.filter
def parameters(count: int) -> str:
    if count >= 10**9:
        return f"{count / 10**9:.1f}B".replace(".0B", "B")
    return f"{count / 10**6:.1f}M"


@register.filter
def binary_bytes(value: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value} B"


@register.filter
def tokens(count: int) -> str:
    if count >= 1024 and count % 1024 == 0:
        return f"{count // 1024}k"
    return f"{count:,}"


@register.filter
def duration(seconds: float | None) -> str:
    return "" if seconds is None else duration_text(seconds)


@register.filter
def cents(amount: int | None) -> str:
    """Cents as dollars, with the sign in front: -$1,234.50."""
    return "" if amount is None else usd(amount)
