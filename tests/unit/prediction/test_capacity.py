"""A replica's capacity: the rate it finishes requests at while full, learned from its scrapes.

The window's finish rate counts every second of the window; after a quiet spell it is the quiet
traffic's rate, not what a full engine does. ``scrape_learning`` keeps the scrape intervals the
replica had requests waiting at both ends of, and the state a forecast sees carries their finish
rate (``ReplicaState.full_finish_rate_per_s``) once there are enough of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from gateway.prediction import PredictionConfig, PredictionService, ReplicaFacts
from gateway.replicas.snapshot import ReplicaSnapshot

FACTS = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    max_num_seqs=4,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
#: The window's rate in every snapshot below: what a replica that was quiet for most of it says.
WINDOW_RATE = 2.0


def scrape(svc: PredictionService, at: float, waiting: int, interval_rate: float) -> None:
    """One scrape at ``at`` (one second after the last): ``waiting`` requests queued, four
    running, ``interval_rate`` requests finished per second since the last scrape."""
    interval = ReplicaSnapshot(
        name="r0",
        taken_at=at,
        metrics_at=at,
        window_s=1.0,
        num_running=4,
        num_waiting=waiting,
        requests_finished_per_s=interval_rate,
    )
    window = dataclasses.replace(interval, window_s=10.0, requests_finished_per_s=WINDOW_RATE)
    svc.on_snapshot(dataclasses.replace(window, last_interval=interval))


def capacity(svc: PredictionService, now: float) -> float | None:
    _, state = svc.replica_inputs("r0", model=MODEL, tenant=None, in_flight=[], now=now)
    return state.full_finish_rate_per_s


def service(config: PredictionConfig | None = None) -> PredictionService:
    svc = PredictionService(config=config)
    svc.set_replica("r0", FACTS)
    return svc


def run(
    svc: PredictionService, seconds: range, waiting: Callable[[int], int], rate: Callable[[int], float]
) -> None:
    for t in seconds:
        scrape(svc, float(t), waiting(t), rate(t))


def test_full_intervals_give_the_rate_a_full_engine_finishes_at() -> None:
    svc = service()
    run(svc, range(1, 12), lambda t: 3, lambda t: 8.0)
    assert capacity(svc, 11.0) == pytest.approx(8.0)
    described = svc.describe(11.0)["replicas"]
    assert isinstance(described, dict)
    assert described["r0"]["capacity_per_s"] == pytest.approx(8.0)


def test_an_interval_that_opened_or_closed_with_room_is_not_full() -> None:
    """Requests waiting at one end only: the engine had room for part of it."""
    svc = service()
    run(svc, range(1, 30), lambda t: 3 if t % 2 else 0, lambda t: 8.0)
    assert capacity(svc, 29.0) is None


def test_too_few_full_seconds_say_nothing() -> None:
    config = PredictionConfig()
    svc = service(config)
    full = int(config.capacity_min_s)  # intervals 2..full: one second short of the minimum
    run(svc, range(1, full + 1), lambda t: 3, lambda t: 8.0)
    assert capacity(svc, float(full)) is None
    scrape(svc, float(full + 1), 3, 8.0)
    assert capacity(svc, float(full + 1)) == pytest.approx(8.0)


def test_it_is_remembered_through_a_quiet_spell_and_then_forgotten() -> None:
    config = PredictionConfig(capacity_memory_s=60.0)
    svc = service(config)
    run(svc, range(1, 12), lambda t: 3, lambda t: 8.0)
    run(svc, range(12, 60), lambda t: 0, lambda t: 1.0)  # quiet: never full
    assert capacity(svc, 59.0) == pytest.approx(8.0)
    run(svc, range(60, 80), lambda t: 0, lambda t: 1.0)
    assert capacity(svc, 79.0) is None


def test_the_newest_full_seconds_count() -> None:
    """Over ``capacity_window_s`` of the newest full intervals: a mix that changed shows at once."""
    config = PredictionConfig(capacity_window_s=10.0)
    svc = service(config)
    run(svc, range(1, 30), lambda t: 3, lambda t: 4.0)
    run(svc, range(30, 41), lambda t: 3, lambda t: 9.0)
    assert capacity(svc, 40.0) == pytest.approx(9.0)


def test_a_gap_in_the_scrapes_breaks_the_interval() -> None:
    """The gauges remembered last belong to a scrape long before this interval opened."""
    svc = service()
    run(svc, range(1, 4), lambda t: 3, lambda t: 8.0)
    run(svc, range(20, 26), lambda t: 3, lambda t: 8.0)
    # 1-3: two intervals; 20: none (its predecessor is 17 s back); 21-25: five.
    assert capacity(svc, 25.0) == pytest.approx(8.0)
    short = service()
    run(short, range(1, 4), lambda t: 3, lambda t: 8.0)
    run(short, range(20, 23), lambda t: 3, lambda t: 8.0)
    # 2 + 2 full seconds: short of the 5 needed (with the gap counted as an interval, 5).
    assert capacity(short, 22.0) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_min_s": 0.0},
        {"capacity_min_s": 40.0},
        {"capacity_window_s": 400.0},
    ],
)
def test_the_knobs_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="capacity"):
        PredictionConfig(**kwargs)  # type: ignore[arg-type]
