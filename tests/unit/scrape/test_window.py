"""Rates, window means and quantiles from scrapes edited by known amounts, under a fake clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from gateway.replicas.dialects import get_dialect
from gateway.replicas.scrape import SnapshotBuilder
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from tests.unit.scrape.scrapes import REAL_032, REAL_V0_010, ScrapeText

VLLM = get_dialect("vllm")
BASE = ScrapeText.fixture(REAL_032)
ITL = "vllm:inter_token_latency_seconds"
ITERATION = "vllm:iteration_tokens_total"
GENERATION = "vllm:generation_tokens_total"

# Five seconds later: every counter bumped and histogram observed by a known amount.
LATER = (
    BASE.add("vllm:prompt_tokens_total", 1000)
    .add("vllm:prompt_tokens_by_source_total", 400, source="local_compute")
    .add("vllm:prompt_tokens_by_source_total", 600, source="local_cache_hit")
    .add("vllm:prefix_cache_queries_total", 1000)
    .add("vllm:prefix_cache_hits_total", 600)
    .add(GENERATION, 500)
    .add("vllm:num_preemptions_total", 5)
    .add("vllm:request_success_total", 3, finished_reason="length")
    .add("vllm:request_success_total", 2, finished_reason="stop")
    .add("vllm:admission_rejections_total", 10, reason="max_num_queued_reqs")
    .observe(ITERATION, 5, 40)  # 40 decode steps of 5 tokens
    .observe(ITERATION, 300, 10)  # 10 mixed steps of 300 tokens
    .observe(ITL, 0.02, 90)  # bucket (0.01, 0.025]
    .observe(ITL, 0.2, 10)  # bucket (0.15, 0.2]
    .observe("vllm:time_to_first_token_seconds", 0.3, 4)  # bucket (0.25, 0.5]
    .observe("vllm:request_queue_time_seconds", 0.1, 5)
    .observe("vllm:e2e_request_latency_seconds", 3.0, 5)
    .observe("vllm:request_prompt_tokens", 200, 5)
    .observe("vllm:request_generation_tokens", 100, 5)
    .set("vllm:num_requests_running", 7)
    .set("vllm:num_requests_waiting", 2)
    .set("vllm:kv_cache_usage_perc", 0.25)
)


def run(*scrapes: tuple[float, str], window_s: float = 10.0) -> ReplicaSnapshot:
    """Feed ``(time, text)`` scrapes in order; the last snapshot."""
    builder = SnapshotBuilder("r1", VLLM, window_s=window_s)
    snapshot = None
    for at, text in scrapes:
        snapshot = builder.observe_text(text, at)
    assert snapshot is not None
    return snapshot


@pytest.fixture(scope="module")
def two_scrapes() -> ReplicaSnapshot:
    return run((100.0, BASE.render()), (105.0, LATER.render()))


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        pytest.param("window_s", 5.0, id="window_s"),
        pytest.param("num_running", 7, id="gauge-running-newest"),
        pytest.param("num_waiting", 2, id="gauge-waiting-newest"),
        pytest.param("kv_cache_usage", 0.25, id="gauge-kv"),
        pytest.param("prompt_tokens_per_s", 1000 / 5, id="prompt-rate"),
        pytest.param("computed_prompt_tokens_per_s", 400 / 5, id="computed-prompt-rate"),
        pytest.param("generation_tokens_per_s", 500 / 5, id="generation-rate"),
        pytest.param("steps_per_s", 50 / 5, id="steps-rate"),
        pytest.param("mean_tokens_per_step", (40 * 5 + 10 * 300) / 50, id="tokens-per-step"),
        pytest.param("requests_finished_per_s", 5 / 5, id="finished-rate-all-reasons"),
        pytest.param("preemptions_per_s", 5 / 5, id="preemption-rate"),
        pytest.param("admission_rejections_per_s", 10 / 5, id="rejection-rate"),
        pytest.param("prefix_cache_hit_rate", 600 / 1000, id="prefix-hit-rate"),
        pytest.param("itl_mean_s", (90 * 0.02 + 10 * 0.2) / 100, id="itl-mean"),
        # rank 50 of 100, all 90 in (0.01, 0.025]: 0.01 + 0.015 * 50/90
        pytest.param("itl_p50_s", 0.01 + 0.015 * 50 / 90, id="itl-p50-interpolated"),
        # rank 90 lands exactly on the 0.025 bucket's count: its upper bound
        pytest.param("itl_p90_s", 0.025, id="itl-p90-on-boundary"),
        pytest.param("ttft_mean_s", 0.3, id="ttft-mean"),
        pytest.param("ttft_p50_s", 0.25 + 0.25 * 2 / 4, id="ttft-p50"),
        pytest.param("ttft_p90_s", 0.25 + 0.25 * 3.6 / 4, id="ttft-p90"),
        pytest.param("queue_time_mean_s", 0.1, id="queue-mean"),
        pytest.param("e2e_mean_s", 3.0, id="e2e-mean"),
        pytest.param("mean_prompt_tokens_per_request", 200.0, id="prompt-per-request"),
        pytest.param("mean_generation_tokens_per_request", 100.0, id="generation-per-request"),
    ],
)
def test_two_scrapes_five_seconds_apart(two_scrapes: ReplicaSnapshot, field: str, expected: float) -> None:
    assert getattr(two_scrapes, field) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def generation_at(value: float) -> str:
    return BASE.set(GENERATION, value).render()


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        pytest.param([(0, 1000), (5, 1500)], 100.0, id="no-reset"),
        pytest.param([(0, 1000), (5, 1000)], 0.0, id="flat-is-a-measured-zero"),
        pytest.param([(0, 3172), (5, 50)], 50 / 5, id="reset-post-value-is-the-increase"),
        pytest.param([(0, 1000), (5, 1100), (10, 40)], (100 + 40) / 10, id="reset-mid-window"),
        pytest.param([(0, 1000), (2, 10), (4, 5)], (10 + 5) / 4, id="two-resets"),
        pytest.param([(0, 1000)], None, id="one-scrape-unknown"),
    ],
)
def test_counter_rate_and_resets(points: list[tuple[float, float]], expected: float | None) -> None:
    snapshot = run(*[(at, generation_at(v)) for at, v in points])

    assert snapshot.generation_tokens_per_s == expected


def test_histogram_reset_uses_the_restarted_histogram() -> None:
    restarted = (
        BASE.reset_histogram(ITL)
        .observe(ITL, 0.05, 10)  # bucket (0.025, 0.05]
        .reset_histogram(ITERATION)
        .observe(ITERATION, 8, 20)
    )

    snapshot = run((0.0, BASE.render()), (5.0, restarted.render()))

    assert snapshot.itl_mean_s == pytest.approx(0.05)
    assert snapshot.itl_p50_s == pytest.approx(0.025 + 0.025 * 5 / 10)
    assert snapshot.steps_per_s == pytest.approx(20 / 5)
    assert snapshot.mean_tokens_per_step == pytest.approx(8.0)


def test_old_scrapes_leave_the_window() -> None:
    scrapes = [
        (0.0, generation_at(0)),
        (5.0, generation_at(1000)),  # a burst that must age out
        (10.0, generation_at(1100)),
        (15.0, generation_at(1200)),
    ]

    snapshot = run(*scrapes, window_s=10.0)

    # At t=15 the window keeps t=5 (exactly 10 s old), 10 and 15: 200 tokens in 10 s.
    assert snapshot.window_s == 10.0
    assert snapshot.generation_tokens_per_s == pytest.approx(20.0)


def test_idle_window_gives_unknown_latency_not_zero() -> None:
    snapshot = run((0.0, BASE.render()), (5.0, BASE.render()))

    assert snapshot.generation_tokens_per_s == 0.0
    assert snapshot.steps_per_s == 0.0
    assert (snapshot.itl_mean_s, snapshot.itl_p50_s, snapshot.ttft_p90_s) == (None, None, None)
    assert snapshot.mean_tokens_per_step is None
    assert snapshot.prefix_cache_hit_rate is None


def test_missing_family_is_unknown() -> None:
    without_ttft = BASE.drop("vllm:time_to_first_token_seconds")

    snapshot = run((0.0, without_ttft.render()), (5.0, without_ttft.render()))

    assert (snapshot.ttft_mean_s, snapshot.ttft_p50_s, snapshot.ttft_p90_s) == (None, None, None)
    assert "ttft_s" not in dict(snapshot.sources)


def test_failed_scrape_keeps_last_good_values_and_window() -> None:
    builder = SnapshotBuilder("r1", VLLM, window_s=10.0)
    first = builder.observe_text(generation_at(1000), 0.0)
    in_flight = (InFlight("req-1", prompt_tokens=120, tokens_streamed=7, started_at=4.0, max_tokens=64),)

    stale = builder.observe_text("garbage here", 5.0, in_flight)
    good = builder.observe_text(generation_at(1200), 10.0)

    assert stale.stale
    assert stale.stale_reason is not None
    assert stale.stale_reason.startswith("not Prometheus text")
    assert (stale.taken_at, stale.metrics_at) == (5.0, 0.0)
    assert stale.num_running == first.num_running == 4
    assert stale.in_flight == in_flight
    assert stale.gateway_in_flight == 1
    assert builder.last_good is good
    assert not good.stale
    assert good.stale_reason is None
    assert good.window_s == 10.0  # the t=0 scrape survived the failure
    assert good.generation_tokens_per_s == pytest.approx(200 / 10)


OLD_NAMES = (
    BASE.rename("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    .rename(ITL, "vllm:time_per_output_token_seconds")
    .rename("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
    .rename("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
)
V0 = ScrapeText.fixture(REAL_V0_010)
OLD_ITL = "vllm:time_per_output_token_seconds"


def renamed_pair() -> tuple[str, str]:
    later = (
        OLD_NAMES.observe(OLD_ITL, 0.02, 50)
        .add("vllm:gpu_prefix_cache_queries_total", 100)
        .add("vllm:gpu_prefix_cache_hits_total", 25)
        .set("vllm:gpu_cache_usage_perc", 0.5)
    )
    return OLD_NAMES.render(), later.render()


def v0_pair() -> tuple[str, str]:
    return V0.render(), V0.observe(OLD_ITL, 0.02, 50).set("vllm:gpu_cache_usage_perc", 0.5).render()


def both_names_pair() -> tuple[str, str]:
    extra = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.9\n'
    )
    later = BASE.observe(ITL, 0.02, 50).set("vllm:kv_cache_usage_perc", 0.5)
    return BASE.render() + extra, later.render() + extra


@pytest.mark.parametrize(
    ("pair", "kv_source", "itl_source", "hit_rate"),
    [
        pytest.param(
            renamed_pair, "vllm:gpu_cache_usage_perc", OLD_ITL, 0.25, id="0.32-renamed-to-old-names"
        ),
        pytest.param(v0_pair, "vllm:gpu_cache_usage_perc", OLD_ITL, None, id="real-v0-0.10"),
        # No prefix-cache traffic between the two: no hit rate.
        pytest.param(both_names_pair, "vllm:kv_cache_usage_perc", ITL, None, id="both-present-new-wins"),
    ],
)
def test_old_names_are_fallbacks(
    pair: Callable[[], tuple[str, str]], kv_source: str, itl_source: str, hit_rate: float | None
) -> None:
    first, second = pair()

    snapshot = run((0.0, first), (5.0, second))

    sources = dict(snapshot.sources)
    assert (sources["kv_cache_usage"], sources["inter_token_latency_s"]) == (kv_source, itl_source)
    assert snapshot.kv_cache_usage == 0.5
    assert snapshot.itl_mean_s == pytest.approx(0.02)
    assert snapshot.itl_p50_s == pytest.approx(0.01 + 0.015 * 25 / 50)
    assert snapshot.prefix_cache_hit_rate == (None if hit_rate is None else pytest.approx(hit_rate))


def engine_scrape(buckets: tuple[float, ...], observations: dict[str, list[float]]) -> str:
    """A two-engine vLLM-like scrape made by prometheus_client itself, with custom TTFT buckets."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge("vllm:num_requests_running", "Running.", labels, registry=registry)
    kv = Gauge("vllm:kv_cache_usage_perc", "KV usage.", labels, registry=registry)
    generated = Counter("vllm:generation_tokens", "Generated.", labels, registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", labels, buckets=buckets, registry=registry)
    config = Gauge(
        "vllm:cache_config_info",
        "Cache config.",
        ["block_size", "engine", "kv_cache_size_tokens", "num_gpu_blocks"],
        registry=registry,
    )
    for engine, (n_running, usage) in {"0": (3, 0.2), "1": (5, 0.6)}.items():
        running.labels(engine, "m").set(n_running)
        kv.labels(engine, "m").set(usage)
        generated.labels(engine, "m").inc(10)
        config.labels("16", engine, "None", "1000").set(1)
        for value in observations.get(engine, []):
            ttft.labels(engine, "m").observe(value)
    return generate_latest(registry).decode()


def test_custom_buckets_and_engines_summed() -> None:
    buckets = (0.5, 1.0, 2.0)
    first = engine_scrape(buckets, {"0": [0.1], "1": [0.1]})
    second = engine_scrape(buckets, {"0": [0.1, 0.75, 0.75], "1": [0.1, 1.5, 1.5]})

    snapshot = run((0.0, first), (10.0, second))

    assert snapshot.num_running == 3 + 5
    assert snapshot.kv_cache_usage == pytest.approx(0.4)
    assert snapshot.kv_cache_usage_max == pytest.approx(0.6)
    assert snapshot.kv_capacity_tokens == 2 * 1000 * 16  # "None" size: blocks x block size per engine
    assert snapshot.block_size == 16
    assert snapshot.generation_tokens_per_s == 0.0
    # Added in the window, both engines: 2 in (0.5, 1], 2 in (1, 2].
    assert snapshot.ttft_mean_s == pytest.approx((2 * 0.75 + 2 * 1.5) / 4)
    assert snapshot.ttft_p50_s == pytest.approx(0.5 + 0.5 * 2 / 2)
    assert snapshot.ttft_p90_s == pytest.approx(1.0 + 1.0 * (3.6 - 2) / 2)


def test_bucket_layout_change_counts_as_a_restart() -> None:
    before = engine_scrape((0.5, 1.0, 2.0), {"0": [0.75] * 5})
    after_restart = engine_scrape((0.1, 0.2), {"0": [0.15, 0.15]})

    snapshot = run((0.0, before), (5.0, after_restart))

    assert snapshot.ttft_mean_s == pytest.approx(0.15)
    assert snapshot.ttft_p50_s == pytest.approx(0.1 + 0.1 * 1 / 2)


def test_in_flight_totals() -> None:
    in_flight = [
        InFlight("a", prompt_tokens=100, tokens_streamed=0, started_at=1.0, max_tokens=None),
        InFlight("b", prompt_tokens=50, tokens_streamed=20, started_at=2.0, max_tokens=256),
    ]

    snapshot = SnapshotBuilder("r1", VLLM).observe_text(BASE.render(), 3.0, in_flight)

    assert snapshot.in_flight == tuple(in_flight)
    assert (
        snapshot.gateway_in_flight,
        snapshot.gateway_prompt_tokens_in_flight,
        snapshot.gateway_decode_tokens_so_far,
    ) == (2, 150, 20)
    assert snapshot.metrics_age_s(4.5) == pytest.approx(1.5)
