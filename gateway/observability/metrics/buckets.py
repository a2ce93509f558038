"""Histogram bucket bounds of Sluice's metrics, in their metrics' units.

Shared by the domains that histogram the same quantity (TTFT and TPOT are both a client's latency
and a replica's observed/predicted one). Changing a tuple changes the exposition and the
dashboards' quantiles: deploy/grafana reads these series.
"""

from __future__ import annotations

from typing import Final

#: Time to first token, seconds: 25 ms (a warm short prompt) to 2 min (a long prompt in a queue).
TTFT_BUCKETS: Final = (
    0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120
)  # fmt: skip
#: Time per output token, seconds: 5 ms (small model, small batch) to 1 s (a stalled stream).
TPOT_BUCKETS: Final = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
#: Whole request, seconds: up to 10 min (long batch generations).
DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
#: Time in Sluice's queue, seconds (class deadlines are 0 to about a minute).
QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
#: Retry-After sent, seconds: capped at 60 (the OpenAI SDKs refuse more).
RETRY_AFTER_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60)
#: Time spent in Sluice itself, seconds: 50 µs to 100 ms.
OVERHEAD_BUCKETS: Final = (5e-05, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
#: Signed relative prediction error (predicted - observed) / observed.
ERROR_BUCKETS: Final = (
    -0.9, -0.75, -0.5, -0.35, -0.25, -0.15, -0.1, -0.05, 0, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1, 2, 5
)  # fmt: skip
#: Absolute relative prediction error; the predictor's targets are 10-15 % median, 25-35 % p90.
ABS_ERROR_BUCKETS: Final = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1, 2, 5)
