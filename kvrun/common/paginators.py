"""Paging for the console's lists over tables that only grow (usage records, events)."""

from django.core.paginator import Paginator
from django.utils.functional import cached_property


class BoundedCountPaginator(Paginator):
    """Counts at most `count_limit` rows.

    An exact COUNT(*) over millions of ledger rows takes seconds, on every page view. A longer
    list says it holds `count_limit` rows and its pages end there; search or a filter narrows
    it to what an operator is looking for.
    """

    count_limit = 10_000

    @cached_property
    def count(self) -> int:
        # A sliced queryset counts in a subquery: SELECT COUNT(*) FROM (... LIMIT n).
        return self.object_list[: self.count_limit].count()  # type: ignore[attr-defined]
