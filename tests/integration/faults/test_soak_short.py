"""A short soak (``bench/soak.py`` for 30 s): the gateway's memory and descriptors stay bounded.

Real processes throughout: two emulated replicas, ``sluice serve`` with two tenants (one over its
budget), 12 closed-loop clients mixing streams read to the end, streams dropped mid-way,
non-streamed requests and over-budget requests. Once with the Redis limiter against a real
``redis-server`` of its own (fail-closed: a Redis call past its 5 s timeout would show as a 503,
which fails the test), once with the in-memory limiter. Wall-clock, so the margins are generous:
what is asserted is the absence of growth proportional to the number of requests (about 1,500
on a quiet machine, 330-340 at load average 20), not an exact figure.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.soak import LimiterKind, fd_bound, soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CLIENTS = 12


@pytest.mark.parametrize("limiter", ["redis", "memory"])
async def test_short_soak_keeps_memory_and_fds_bounded(limiter: LimiterKind) -> None:
    report = await asyncio.to_thread(
        soak, duration_s=30.0, clients=CLIENTS, sample_s=2.0, warmup_s=10.0, idle_s=5.0, limiter=limiter
    )
    print(report.text())
    # The mix really ran: answers of every kind, streams dropped mid-way, over-budget refusals.
    assert report.statuses.get("200", 0) > 100, report.statuses
    assert report.statuses.get("dropped", 0) > 20, report.statuses
    assert report.statuses.get("429", 0) > 20, report.statuses
    assert set(report.statuses) <= {"200", "429", "dropped"}, report.statuses
    # Memory: after the warm-up (pools, caches, the step model filled), 20 s of load add little.
    # A leak of even 10 KiB per request would add about 10 MiB here; a sane gateway adds ~1 MiB.
    assert report.growth_mib < 24.0, report.text()
    assert report.max_rss_mib < report.baseline.rss_mib + 96.0, report.text()
    # Descriptors: back near the baseline once the clients are gone (keep-alive pool aside).
    assert report.idle.fds <= fd_bound(report, CLIENTS, slack=8), report.text()
    assert report.limiter == limiter
    if limiter == "redis":
        # Redis holds the tenants' buckets and lease sets, not one key per request.
        assert report.redis_keys is not None
        assert report.redis_keys <= 6, report.text()
        assert report.redis_rss_mib is not None
        assert report.redis_rss_mib[1] < report.redis_rss_mib[0] + 32.0, report.text()
