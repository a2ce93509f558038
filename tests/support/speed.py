"""How much slower than an idle development container this host runs Python right now.

Live tests keep a few wall-clock bounds (a process must start, a refusal must come back). Those
bounds are sanity checks, not targets, and must not fail because the machine is shared or slow:
multiply them by :func:`factor`.

Contract:

* :func:`factor` returns a finite float ``>= 1.0``: the mean wall time of a fixed,
  deterministic pure-Python workload (:func:`workload`, ~5 ms) over a window of repeats (~0.1 s),
  divided by :data:`REFERENCE_S`, the same mean on an idle 2-core development container; 1.0 on
  a host at least that fast and idle. The window spans several scheduler time slices, so that
  time-sharing with other busy processes, the usual reason a live test runs slow, raises the
  factor (a single ~5 ms run often fits in one slice and would not show it).
* The first call measures and caches the value for the rest of the process (a pytest session);
  ``factor(fresh=True)`` measures again (at the point of use) and returns the larger of the two,
  so a bound never shrinks within a session.
* :func:`scaled` is ``seconds * factor()``; :func:`widened` stretches a (low, high) band of
  ratios both ways by it.
"""

from __future__ import annotations

import math
import time

__all__ = ["REFERENCE_S", "factor", "measure", "scaled", "widened", "workload"]

#: Mean seconds of one :func:`workload` on an idle 2-core development container (CPython 3).
REFERENCE_S = 0.0052
#: Iterations of the workload's loop (about 5 ms on the reference host).
_ITERATIONS = 20_000
_REPEATS = 20

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
    """Mean wall seconds of one :func:`workload` over ``repeats`` back-to-back runs (``repeats >= 1``)."""
    start = time.perf_counter()
    for _ in range(repeats):
        workload()
    return (time.perf_counter() - start) / repeats


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


def widened(low: float, high: float) -> tuple[float, float]:
    """The band ``[low, high]`` of a ratio of two timings (``0 < low <= 1 <= high``) widened by
    :func:`factor` both ways: ``(low / factor(), high * factor())``. For ratios whose two sides
    carry the host's stalls differently (a forecast against a measurement)."""
    slow = factor()
    return low / slow, high * slow
