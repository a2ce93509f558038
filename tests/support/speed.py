"""How much slower than an idle development container this host runs Python right now.

Live tests keep a few wall-clock bounds (a process must start, a refusal must come back). Those
bounds are sanity checks, not targets, and must not fail because the machine is shared or slow:
multiply them by :func:`factor`.

Contract:

* :func:`factor` returns a finite float ``>= 1.0``: the median wall time of a fixed,
  deterministic pure-Python workload (:func:`workload`, a few ms) over a few repeats, divided by
  :data:`REFERENCE_S`, the same median on an idle 2-core development container; 1.0 on a host
  at least that fast and idle. The median (not the best) is taken so that time-sharing with
  other busy processes, the usual reason a live test runs slow, raises the factor.
* The first call measures and caches the value for the rest of the process (a pytest session);
  ``factor(fresh=True)`` measures again (at the point of use) and returns the larger of the two,
  so a bound never shrinks within a session.
* :func:`scaled` is ``seconds * factor()``.
"""

from __future__ import annotations

import math
import statistics
import time

__all__ = ["REFERENCE_S", "factor", "measure", "scaled", "workload"]

#: Median seconds of one :func:`workload` on an idle 2-core development container (CPython 3).
REFERENCE_S = 0.0052
#: Iterations of the workload's loop (about 5 ms on the reference host).
_ITERATIONS = 20_000
_REPEATS = 7

_cached: float | None = None


def workload(iterations: int = _ITERATIONS) -> int:
    """A fixed CPU-bound pure-Python computation (integer arithmetic and dict stores); its result
    is deterministic so the interpreter cannot skip it."""
    x = 12345
    acc = 0
    table: dict[int, int] = {}
    for i in range(iterations):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        acc ^= x >> (i & 7)
        table[x & 1023] = acc
    return acc + len(table)


def measure(repeats: int = _REPEATS) -> float:
    """Median wall seconds of one :func:`workload` over ``repeats`` runs (``repeats >= 1``)."""
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        workload()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def factor(*, fresh: bool = False) -> float:
    """The host-speed factor (``>= 1.0``, finite), measured once per process unless ``fresh``."""
    global _cached
    if _cached is None or fresh:
        measured = measure() / REFERENCE_S
        value = max(1.0, measured) if math.isfinite(measured) else 1.0
        _cached = value if _cached is None else max(_cached, value)
    return _cached


def scaled(seconds: float) -> float:
    """``seconds`` stretched by :func:`factor`: a sanity bound that holds on a slow host."""
    return seconds * factor()
