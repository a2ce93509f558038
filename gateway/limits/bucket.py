"""Token-bucket arithmetic shared by every backend: pure functions of numbers, no clock, no I/O.

A bucket is one number, ``full_at``: the time (seconds, on the backend's clock) at which it is
full again; ``level = capacity - max(full_at - now, 0) * rate``, so an absent or past ``full_at``
is a full bucket. Taking ``amount`` moves ``full_at`` later by ``amount / rate``; a refund moves it
earlier, never before ``now``; a charge beyond the level leaves a debt that refills like any
deficit. ``token_bucket.lua`` implements the same rules; the contract suite checks they agree.
"""

from __future__ import annotations

import math


def level_at(full_at: float, now: float, rate: float, capacity: float) -> float:
    """Tokens in the bucket at ``now``; at most ``capacity``, negative when in debt.

    ``rate`` is in tokens per second (> 0), ``capacity`` in tokens.
    """
    return capacity - max(full_at - now, 0.0) * rate


def full_at_for(level: float, now: float, rate: float, capacity: float) -> float:
    """The ``full_at`` that encodes ``level`` tokens at ``now`` (``now`` itself when full or above)."""
    return now + max(capacity - level, 0.0) / rate


def wait_for(need: float, level: float, rate: float) -> float:
    """Seconds until a bucket at ``level`` holds ``need`` tokens at ``rate`` tokens/s (0.0 if it does)."""
    return max(need - level, 0.0) / rate


def reset_after(level: float, rate: float, capacity: float) -> float:
    """Seconds until a bucket at ``level`` is full again (OpenAI's ``x-ratelimit-reset-*``)."""
    return max(capacity - level, 0.0) / rate


def settled_level(level: float, diff: float, capacity: float) -> float:
    """The level after charging ``diff`` more tokens (negative: a refund), capped at ``capacity``."""
    return min(level - diff, capacity)


def scaled_concurrency(max_concurrent: int, share: float) -> int:
    """A gateway's share of a concurrency limit: ``ceil(max_concurrent * share)``, at least 1.

    Rounding up keeps a tenant with a small limit usable on every gateway during an outage; the
    cluster-wide overshoot is then at most one request per gateway.
    """
    return max(1, math.ceil(max_concurrent * share - 1e-9))
