"""Money as kvrun keeps it, in whole cents, and as a person reads it."""

from decimal import ROUND_HALF_UP, Decimal


def cents(dollars: Decimal) -> int:
    """Dollars in whole cents, half a cent rounded up (away from zero)."""
    return int((dollars * 100).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def usd(amount_cents: int) -> str:
    """Cents as dollars, with the sign in front: -$1,234.50."""
    dollars = Decimal(abs(amount_cents)) / 100
    return f"{'-' if amount_cents < 0 else ''}${dollars:,.2f}"
