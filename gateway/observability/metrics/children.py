"""Labelled children of Prometheus metrics, memoised, and cheaper updaters for the hot path.

``Children`` is shared by every domain of ``SluiceMetrics``: ``child`` is ``metric.labels(...)``
as one dict lookup; ``observer`` and ``counter`` return a callable that updates one child's
series exactly as ``observe`` / ``inc`` would, without prometheus_client's per-call checks.
Nothing here removes children, so label values must be bounded (see ``labels``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import TypeVar, cast

from prometheus_client import Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


def _fast_observe(child: Histogram) -> Callable[[float], None]:
    """``child.observe`` (one labelled child, no exemplar) as prometheus_client 0.26 does it: the
    sum grows by the amount and the first bucket whose upper bound is >= the amount counts one
    (none for NaN); the bucket found by bisection. ``child.observe`` itself when the child does
    not have that layout (another prometheus_client)."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if (
        not isinstance(bounds, list)
        or not isinstance(buckets, list)
        or len(bounds) != len(buckets)
        or not bounds
        or bounds[-1] != math.inf
        or not callable(getattr(total, "inc", None))
    ):
        return child.observe
    upper = [float(b) for b in bounds]
    incs = [b.inc for b in buckets]
    add = total.inc  # type: ignore[union-attr]
    find = bisect.bisect_left

    def observe(amount: float) -> None:
        add(amount)
        if amount == amount:  # not NaN: some bound (the last is +Inf) is >= it
            incs[find(upper, amount)](1)

    return observe


class Children:
    """Memoised children and updaters of any metric, keyed by metric and label values.

    Not thread-safe beyond prometheus_client's own locking; call from the event loop.
    """

    def __init__(self) -> None:
        #: ``child``'s memo: per metric, its children by label values.
        self._children: dict[MetricWrapperBase, dict[tuple[str, ...], MetricWrapperBase]] = {}
        #: ``observer``'s and ``counter``'s memo: per metric, by label values.
        self._updaters: dict[MetricWrapperBase, dict[tuple[str, ...], Callable[[float], None]]] = {}

    def child(self, metric: _Metric, *values: str) -> _Metric:
        """``metric.labels(*values)``, memoised per metric and label values: one dict lookup
        instead of prometheus_client's validation, string conversion and lock on every call
        (several per request). Nothing here removes children,
        so the memoised child is the one ``labels`` returns; label values are bounded (classes
        and tenants by ``set_known_labels``, replicas by the configuration)."""
        children = self._children.get(metric)
        if children is None:
            children = self._children[metric] = {}
        found = children.get(values)
        if found is None:
            found = children[values] = metric.labels(*values)
        return cast(_Metric, found)

    def observer(self, histogram: Histogram, *values: str) -> Callable[[float], None]:
        """``histogram.labels(*values).observe``, memoised, and cheaper to call: the bucket found
        by bisection, not by prometheus_client's loop over the bounds, then the same counts
        incremented (``_fast_observe``)."""
        updaters = self._updaters.get(histogram)
        if updaters is None:
            updaters = self._updaters[histogram] = {}
        found = updaters.get(values)
        if found is None:
            found = updaters[values] = _fast_observe(self.child(histogram, *values))
        return found

    def counter(self, counter: Counter, *values: str) -> Callable[[float], None]:
        """``counter.labels(*values).inc`` for amounts known to be >= 0 (``1``), memoised: the
        child's value incremented directly (``Counter.inc`` checks the sign on every call)."""
        updaters = self._updaters.get(counter)
        if updaters is None:
            updaters = self._updaters[counter] = {}
        found = updaters.get(values)
        if found is None:
            child = self.child(counter, *values)
            value = getattr(child, "_value", None)
            inc = getattr(value, "inc", None)
            found = updaters[values] = inc if callable(inc) else child.inc
        return found
