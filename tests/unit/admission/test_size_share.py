"""Size fairness's band tracker: quartiles learned from the window, rates, starvation, reload (pure)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from gateway.admission.config import AdmissionSettings, SizeFairnessSettings
from gateway.admission.size_share import SizeShares, SizeShareTracker

#: Four sizes, one per quartile once 100 of each are seen.
SIZES = (100, 500, 1000, 3000)


def feed(tracker: SizeShareTracker, t: float, rates: tuple[float, ...], n: int = 40) -> float:
    """``n`` decisions per size of ``SIZES``, 0.01 s apart from ``t``, the share ``rates[k]`` of
    size k's admitted (evenly spread); the last instant."""
    for i in range(n):
        for size, rate in zip(SIZES, rates, strict=True):
            t += 0.01
            tracker.record(size, math.floor((i + 1) * rate) > math.floor(i * rate), t)
    return t


def test_quartile_edges_follow_the_window_as_the_bench_cuts_them() -> None:
    tracker = SizeShareTracker(SizeFairnessSettings())
    t = feed(tracker, 0.0, (1.0, 1.0, 1.0, 1.0))
    shares = tracker.shares(t)
    assert shares.edges == SIZES[:3]  # nearest rank: each edge a size that occurs
    assert shares.offered == (40, 40, 40, 40)
    assert [shares.band(s) for s in (1, 100, 101, 500, 2000, 10_000)] == [0, 0, 1, 1, 3, 3]
    assert not shares.starved


@pytest.mark.parametrize(
    ("rates", "starved"),
    [
        pytest.param((1.0, 0.9, 0.6, 0.5), set(), id="longest at half the best: held"),
        pytest.param((1.0, 0.9, 0.6, 0.3), {3}, id="longest at 0.3 of the best"),
        pytest.param((0.5, 0.45, 0.1, 0.05), {2, 3}, id="two bands under 0.4 of 0.5"),
        pytest.param((0.0, 0.0, 0.0, 0.0), set(), id="nothing admitted: nobody to yield to"),
    ],
)
def test_bands_below_min_share_of_the_best_are_starved(rates: tuple[float, ...], starved: set[int]) -> None:
    tracker = SizeShareTracker(SizeFairnessSettings(min_share=0.4))
    t = feed(tracker, 0.0, rates)
    shares = tracker.shares(t)
    assert shares.rates() == pytest.approx(rates)
    assert set(shares.starved) == starved
    assert tracker.starved(3000, t) is (3 in starved)
    assert tracker.starved(100, t) is (0 in starved)


@pytest.mark.parametrize(
    ("rates", "standings"),
    [
        pytest.param((0.5, 0.45, 0.1, 0.05), (None, None, 0.2, 0.1), id="two bands starved"),
        pytest.param((0.5, 0.5, 0.5, 0.0), (None, None, None, 0.0), id="one band shut out"),
        pytest.param((1.0, 0.9, 0.6, 0.5), (None, None, None, None), id="none starved"),
    ],
)
def test_a_starved_band_s_standing_is_its_rate_over_the_best(
    rates: tuple[float, ...], standings: tuple[float | None, ...]
) -> None:
    tracker = SizeShareTracker(SizeFairnessSettings(min_share=0.4))
    t = feed(tracker, 0.0, rates)
    got = [tracker.standing(size, t) for size in SIZES]
    assert got == [None if s is None else pytest.approx(s) for s in standings]
    shares = tracker.shares(t)
    assert shares.best_rate == pytest.approx(max(rates))
    assert [shares.standing(k) for k in range(4)] == pytest.approx([r / max(rates) for r in rates])


def test_a_band_is_judged_only_with_min_samples() -> None:
    tracker = SizeShareTracker(SizeFairnessSettings(min_samples=41))
    t = feed(tracker, 0.0, (1.0, 1.0, 1.0, 0.0))
    assert not tracker.shares(t).starved
    t = feed(tracker, t, (1.0, 1.0, 1.0, 0.0), n=1)
    assert tracker.shares(t + 1.0).starved == {3}


def test_the_window_forgets_old_decisions() -> None:
    tracker = SizeShareTracker(SizeFairnessSettings(window_s=10.0))
    t = feed(tracker, 0.0, (1.0, 1.0, 1.0, 0.0))
    assert tracker.starved(3000, t)
    t = feed(tracker, t + 20.0, (1.0, 1.0, 1.0, 1.0))
    shares = tracker.shares(t)
    assert shares.offered == (40, 40, 40, 40)
    assert not shares.starved


def test_memory_is_bounded_by_max_samples() -> None:
    tracker = SizeShareTracker(SizeFairnessSettings(max_samples=100))
    t = feed(tracker, 0.0, (1.0, 1.0, 1.0, 1.0), n=100)
    assert sum(tracker.shares(t + 1.0).offered) == 100


def test_rates_refresh_every_32_decisions_or_each_second() -> None:
    tracker = SizeShareTracker(SizeFairnessSettings(min_samples=1))
    t = feed(tracker, 0.0, (1.0, 1.0, 1.0, 1.0), n=10)
    assert not tracker.starved(3000, t)
    for _ in range(5):  # fewer than 32 new decisions within the second: the cached rates stand
        t += 0.01
        tracker.record(3000, False, t)
    assert sum(tracker.shares(t).offered) == 40
    assert sum(tracker.shares(t, fresh=True).offered) == 45
    assert sum(tracker.shares(t + 1.0).offered) == 45


def test_shares_per_class_protect_only_where_enabled_and_follow_reload() -> None:
    on = AdmissionSettings.model_validate(
        {"classes": {"a": {}, "b": {"size_fairness": {"enabled": False}}}, "default_class": "a"}
    )
    shares = SizeShares(on)
    t = 0.0
    for i in range(200):
        t += 0.01
        for name in ("a", "b"):
            shares.record(name, SIZES[i % 4], i % 4 != 3, t)
    assert shares.protects("a", 3000, t)
    assert not shares.protects("a", 100, t)
    assert not shares.protects("b", 3000, t)  # off: never protected, still measured
    assert shares.as_json(t)["b"]["protected_bands"] == [3]
    assert shares.as_json(t)["a"]["admission_rate"] == [1.0, 1.0, 1.0, 0.0]
    off = AdmissionSettings.model_validate(
        {"classes": {"a": {"size_fairness": {"enabled": False}}}, "default_class": "a"}
    )
    shares.reconfigure(off)
    assert not shares.protects("a", 3000, t)
    assert set(shares.as_json(t)) == {"a"}  # class b is gone


@pytest.mark.parametrize(
    ("section", "where"),
    [
        pytest.param({"min_share": 0.0}, "min_share", id="min_share 0"),
        pytest.param({"min_share": 1.5}, "min_share", id="min_share over 1"),
        pytest.param({"window_s": 0}, "window_s", id="empty window"),
        pytest.param({"min_samples": 0}, "min_samples", id="no samples"),
        pytest.param({"max_samples": 3}, "max_samples", id="fewer samples than bands"),
        pytest.param({"bands": 8}, "bands", id="unknown key"),
    ],
)
def test_bad_settings_are_refused(section: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError) as raised:
        AdmissionSettings.model_validate({"classes": {"a": {"size_fairness": section}}, "default_class": "a"})
    assert f"classes.a.size_fairness.{where}" in str(raised.value).replace("\n", ".").replace(" ", "")
