"""``AdmissionStats``' observation lists stay bounded when nobody drains them (a flood of 429s in
the live gateway, whose metrics count outcomes instead): the newest are kept, in order."""

from __future__ import annotations

import pytest

from gateway.admission.stats import OBSERVATIONS_KEPT, AdmissionStats


@pytest.mark.parametrize(
    "count",
    [0, 1, OBSERVATIONS_KEPT - 1, OBSERVATIONS_KEPT, OBSERVATIONS_KEPT + 1, 3 * OBSERVATIONS_KEPT + 7],
)
def test_observations_are_bounded_and_keep_the_newest(count: int) -> None:
    stats = AdmissionStats()
    for i in range(count):
        stats.observe_retry_after("deadline_exceeded", float(i))
        stats.observe_queue_wait("interactive", float(i))
    waits, retries = stats.drain_observations()
    for kept in (waits, retries):
        assert len(kept) <= OBSERVATIONS_KEPT
        assert len(kept) == count or len(kept) >= OBSERVATIONS_KEPT // 2
        assert [v for _, v in kept] == [float(i) for i in range(count - len(kept), count)]
    assert stats.drain_observations() == ([], [])
