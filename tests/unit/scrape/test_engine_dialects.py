"""The TGI and SGLang dialects, engine detection, and what the step calibration gets from them.

SGLang: the real docs scrape of ~v0.4 (``tests/data/metrics/sglang-v0.4-docs-production_metrics.txt``)
and, for the recent label set (TP/DP ranks, priority), text built from the reference's §3 lists.
TGI: no real scrape exists in public, so its text is BUILT from the reference's TGI metric list
(``tests/unit/scrape/tgi_text.py`` says how); only the values are the test's.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from gateway.prediction.state import GaugeMeans, window_stats
from gateway.replicas.dialects import (
    AUTO,
    DIALECTS,
    CounterName,
    Histogram,
    HistogramName,
    detect,
    engine_from_info,
    get_dialect,
)
from gateway.replicas.exposition import parse_exposition
from gateway.replicas.scrape import SnapshotBuilder, histogram_moments
from predictor import ObservationSource, observation_from_window
from tests.unit.scrape.scrapes import REAL_032, REAL_V0_010, ScrapeText, fixture_text
from tests.unit.scrape.tgi_text import Observed, TgiState, tgi_exposition

SGLANG_SAMPLE = "sglang-v0.4-docs-production_metrics.txt"
TGI = get_dialect("tgi")
SGLANG = get_dialect("sglang")


# -- TGI -------------------------------------------------------------------------------------------


def test_tgi_gauges_and_capacity_from_one_scrape() -> None:
    reading = TGI.read(parse_exposition(tgi_exposition(TgiState())))

    assert reading.gauges.num_running == 8
    assert reading.gauges.num_waiting == 3
    assert reading.gauges.kv_capacity_tokens == 60_000
    # KV usage is what the running batch reserves over the capacity found at warmup.
    assert reading.gauges.kv_cache_usage == pytest.approx(12_000 / 60_000)
    assert reading.gauges.block_size is None
    assert reading.model_names == ()  # TGI's metrics carry no model label
    assert reading.sources["kv_capacity_tokens"] == "tgi_batch_max_total_tokens"


def test_tgi_counters_without_total_are_found_under_the_parsers_name() -> None:
    """TGI exposes ``tgi_request_failure{err=...}``; prometheus_client names the sample ``..._total``."""
    reading = TGI.read(parse_exposition(tgi_exposition(TgiState())))

    assert reading.counters[CounterName.ADMISSION_REJECTIONS] == 6
    assert reading.sources["admission_rejections"] == "tgi_request_failure_total"
    # Finished = successes + failures after admission (the 429s never entered the engine).
    assert reading.counters[CounterName.REQUESTS_FINISHED] == 80 + 2
    assert reading.counters[CounterName.STEPS] == 1000
    assert reading.counters[CounterName.PROMPT_TOKENS] == 100 * 500
    assert reading.counters[CounterName.GENERATION_TOKENS] == 80 * 200
    assert HistogramName.TTFT not in reading.histograms  # TGI has no TTFT histogram
    assert CounterName.PREEMPTIONS not in reading.counters  # nor preemption


def _tgi_window() -> tuple[TgiState, TgiState, float]:
    before = TgiState()
    after = dataclasses.replace(
        before,
        requests=before.requests + 30,
        success=before.success + 20,
        failures={"overloaded": 6 + 4, "dropped": 2 + 1},
        decode=Observed(before.decode.count + 400, 0.012),
        prefill=Observed(before.prefill.count + 20, 0.050),
        input_tokens=Observed(before.input_tokens.count + 24, 500.0),
        generated_tokens=Observed(before.generated_tokens.count + 20, 200.0),
        queue_duration=Observed(before.queue_duration.count + 20, 0.2),
        request_duration=Observed(before.request_duration.count + 20, 3.0),
    )
    return before, after, 4.0


def test_tgi_snapshot_measures_step_time_directly() -> None:
    before, after, dt = _tgi_window()
    builder = SnapshotBuilder("tgi-1", TGI)
    builder.observe_text(tgi_exposition(before), 100.0)
    snap = builder.observe_text(tgi_exposition(after), 100.0 + dt)

    assert not snap.stale
    assert snap.dialect == "tgi"
    # 400 decode + 20 prefill forward passes in 4 s, each observed once by the forward histogram.
    assert snap.steps_per_s == pytest.approx(420 / dt)
    assert snap.decode_steps_per_s == pytest.approx(400 / dt)
    assert snap.step_time_mean_s == pytest.approx((400 * 0.012 + 20 * 0.050) / 420)
    assert snap.decode_step_time_mean_s == pytest.approx(0.012)
    assert snap.prefill_step_time_mean_s == pytest.approx(0.050)
    assert snap.itl_mean_s == pytest.approx(0.012)  # the decode step time: tokens come at that period
    assert snap.prompt_tokens_per_s == pytest.approx(24 * 500 / dt)
    assert snap.generation_tokens_per_s == pytest.approx(20 * 200 / dt)
    assert snap.admission_rejections_per_s == pytest.approx(4 / dt)
    assert snap.requests_finished_per_s == pytest.approx(21 / dt)
    assert snap.queue_time_mean_s == pytest.approx(0.2)
    assert snap.e2e_mean_s == pytest.approx(3.0)
    assert snap.mean_prompt_tokens_per_request == pytest.approx(500.0)
    assert snap.ttft_mean_s is None
    assert snap.request_prefill_step_time_mean_s is None  # no tgi_batch_next_size in this scrape
    assert dict(snap.sources)["step_time_s"] == "tgi_batch_inference_duration"
    assert dict(snap.sources)["decode_step_time_s"] == 'tgi_batch_inference_duration{method="decode"}'


def test_tgi_prefill_step_weighted_by_the_requests_each_started() -> None:
    """The window's 20 prefill steps (50 ms each on average) started 24 requests: 16 alone, 4
    steps two each (``tgi_batch_next_size``). Over the requests, the step that prefilled them is
    longer than over the steps: the 12 ms decode step it rides along plus an equal share per
    request, ``E[n^2] / E[n]^2 = (32 / 20) / 1.2^2`` times the rest."""
    before, after, dt = _tgi_window()
    before = dataclasses.replace(before, next_sizes={1: 100})
    after = dataclasses.replace(after, next_sizes={1: 116, 2: 4})
    builder = SnapshotBuilder("tgi-1", TGI)
    builder.observe_text(tgi_exposition(before), 100.0)
    snap = builder.observe_text(tgi_exposition(after), 100.0 + dt)

    assert snap.prefill_step_time_mean_s == pytest.approx(0.050)
    assert snap.request_prefill_step_time_mean_s == pytest.approx(0.012 + 0.038 * (32 / 20) / 1.2**2)
    # One request per step: every request's step is the mean step.
    single = dataclasses.replace(after, next_sizes={1: 120})
    builder = SnapshotBuilder("tgi-1", TGI)
    builder.observe_text(tgi_exposition(before), 100.0)
    snap = builder.observe_text(tgi_exposition(single), 100.0 + dt)
    assert snap.request_prefill_step_time_mean_s == pytest.approx(0.050)


def test_histogram_moments_of_integer_buckets_and_overflow() -> None:
    # 3 observations of 1, 1 of 2, and 2 beyond the last bound (3) summing to 10.
    h = Histogram(bounds=(1.0, 2.0, 3.0, math.inf), cumulative=(3.0, 4.0, 4.0, 6.0), sum=15.0, count=6.0)
    mean, square = histogram_moments(h)  # type: ignore[misc]
    assert mean == pytest.approx(15 / 6)
    assert square == pytest.approx((3 * 1 + 1 * 4 + 2 * 25) / 6)
    assert histogram_moments(Histogram((1.0, math.inf), (0.0, 0.0), 0.0, 0.0)) is None


def test_tgi_step_time_falls_back_to_the_forward_duration() -> None:
    """Without ``tgi_batch_inference_duration`` (the whole step), the forward pass alone is read."""
    before, after, dt = _tgi_window()

    def forward_only(state: TgiState) -> str:
        text = tgi_exposition(state)
        kept = [line for line in text.splitlines() if "tgi_batch_inference_duration" not in line]
        return "\n".join(kept) + "\n"

    builder = SnapshotBuilder("tgi-1", TGI)
    builder.observe_text(forward_only(before), 100.0)
    snap = builder.observe_text(forward_only(after), 100.0 + dt)

    assert snap.decode_step_time_mean_s == pytest.approx(0.012)
    assert snap.prefill_step_time_mean_s == pytest.approx(0.050)
    assert dict(snap.sources)["decode_step_time_s"] == 'tgi_batch_forward_duration{method="decode"}'


def test_tgi_snapshot_feeds_the_step_calibration() -> None:
    """The calibrator's input and one valid observation come out of a TGI window as they stand."""
    before, after, dt = _tgi_window()
    builder = SnapshotBuilder("tgi-1", TGI)
    builder.observe_text(tgi_exposition(before), 100.0)
    snap = builder.observe_text(tgi_exposition(after), 100.0 + dt)
    gauges = GaugeMeans(running=8.0, waiting=3.0, kv_tokens=12_000.0, busy=True)

    stats = window_stats(snap, gauges)

    assert stats is not None
    assert stats.steps_per_s == pytest.approx(420 / dt)
    assert stats.prompt_tokens_per_s == pytest.approx(24 * 500 / dt)
    observation = observation_from_window(stats, knee_tokens=2048.0)
    assert observation.valid
    # Each step decodes generation rate / step rate sequences; the step time is the period.
    assert observation.batch.decode_seqs == pytest.approx((20 * 200 / dt) / (420 / dt))
    assert observation.step_s == pytest.approx(dt / 420)


# -- SGLang ----------------------------------------------------------------------------------------


def test_sglang_real_sample_one_scrape() -> None:
    reading = SGLANG.read(parse_exposition(fixture_text(SGLANG_SAMPLE)))
    g = reading.gauges

    assert g.num_running == 162
    assert g.num_waiting == 2826
    assert g.kv_cache_usage == pytest.approx(0.28)
    # No max_total_num_tokens in ~v0.4: estimated from tokens used over usage, and labelled so.
    assert g.kv_capacity_tokens == round(123859 / 0.28)
    assert reading.sources["kv_capacity_tokens"].endswith("(estimate)")
    assert g.decode_tokens_per_s == pytest.approx(86.50814177726902)
    assert reading.model_names == ("meta-llama/Llama-3.1-8B-Instruct",)
    assert reading.counters[CounterName.PROMPT_TOKENS] == pytest.approx(8.128902e06)
    assert reading.counters[CounterName.GENERATION_TOKENS] == pytest.approx(7.557572e06)
    # The old ITL name is the fallback; TTFT and e2e are read as they are.
    assert reading.sources["inter_token_latency_s"] == "sglang:time_per_output_token_seconds"
    assert reading.histograms[HistogramName.TTFT].count == 11008
    assert reading.histograms[HistogramName.E2E].count == 11228


def test_sglang_real_sample_window_estimates_decode_steps() -> None:
    first = ScrapeText.fixture(SGLANG_SAMPLE)
    second = (
        first.add("sglang:generation_tokens_total", 4000)
        .add("sglang:prompt_tokens_total", 9000)
        .observe("sglang:time_per_output_token_seconds", 0.07, n=3000)
        .observe("sglang:time_to_first_token_seconds", 0.9, n=10)
    )
    builder = SnapshotBuilder("sg-1", SGLANG)
    builder.observe_text(first.render(), 10.0)
    snap = builder.observe_text(second.render(), 12.0)

    assert snap.generation_tokens_per_s == pytest.approx(2000.0)
    assert snap.prompt_tokens_per_s == pytest.approx(4500.0)
    assert snap.itl_mean_s == pytest.approx(0.07)
    assert snap.ttft_mean_s == pytest.approx(0.9)
    # No step counter in ~v0.4: decode steps/s = gen_throughput / running, said in sources.
    assert snap.steps_per_s == pytest.approx(86.50814177726902 / 162)
    assert "estimate" in dict(snap.sources)["steps_per_s"]
    assert snap.engine_decode_tokens_per_s == pytest.approx(86.50814177726902)
    assert snap.step_time_mean_s is None
    assert snap.steps_estimated


def test_sglang_estimated_decode_steps_give_no_step_period() -> None:
    """``gen_throughput`` is the decode tokens of the last 40 decode steps over the wall time
    since the previous log, prefill batches and idle time included: its rate per running request
    counts decode steps alone, and the time it spans holds the others too. In the real scrape it
    says 162 / 86.5 = 1.87 s per decode step, where the TPOT histogram's mean is 0.117 s (a queue of
    2826 kept it prefilling). The calibration takes the ITL as the step time, busy or not."""
    first = ScrapeText.fixture(SGLANG_SAMPLE)
    second = (
        first.add("sglang:generation_tokens_total", 4000)
        .add("sglang:prompt_tokens_total", 9000)
        .observe("sglang:time_per_output_token_seconds", 0.07, n=3000)
    )
    builder = SnapshotBuilder("sg-1", SGLANG)
    builder.observe_text(first.render(), 10.0)
    snap = builder.observe_text(second.render(), 12.0)
    gauges = GaugeMeans(running=162.0, waiting=2826.0, kv_tokens=123_859.0, busy=True)

    stats = window_stats(snap, gauges)

    assert stats is not None
    assert not stats.steps_counted
    observation = observation_from_window(stats, knee_tokens=2048.0)
    assert observation.valid
    assert observation.source == ObservationSource.WINDOW_ITL
    assert observation.step_s == pytest.approx(0.07)
    # Counted steps (recent SGLang, vLLM's iteration histogram) give the period when busy (and
    # the period is within 1.5x the ITL); estimated ones never do.
    slower = dataclasses.replace(stats, mean_itl_s=1.5)
    assert observation_from_window(slower, knee_tokens=2048.0).step_s == pytest.approx(1.5)
    counted = observation_from_window(dataclasses.replace(slower, steps_counted=True), knee_tokens=2048.0)
    assert counted.source == ObservationSource.WINDOW_PERIOD
    assert counted.step_s == pytest.approx(162 / 86.50814177726902)


def _recent_sglang(dispatches: float, busy_s: float, decode_tokens: float) -> str:
    """Recent SGLang label set, BUILT from the reference's §3.1/§3.2 (no real recent scrape exists):
    two DP ranks, each reported by TP ranks 0 and 1 (``--enable-metrics-for-all-schedulers``),
    and a priority breakdown under the ``priority=""`` total."""
    lines = [
        "# TYPE sglang:num_running_reqs gauge",
        "# TYPE sglang:max_total_num_tokens gauge",
        "# TYPE sglang:token_usage gauge",
        "# TYPE sglang:page_size gauge",
        "# TYPE sglang:scheduler_loop_batch_dispatches_total counter",
        "# TYPE sglang:forward_execution_seconds_total counter",
        "# TYPE sglang:realtime_tokens_total counter",
    ]
    for dp, running in (("0", 10), ("1", 6)):
        for tp in ("0", "1"):
            base = f'dp_rank="{dp}",engine_type="unified",model_name="m",pp_rank="0",tp_rank="{tp}"'
            lines += [
                f'sglang:num_running_reqs{{{base},priority=""}} {running}',
                f'sglang:num_running_reqs{{{base},priority="1"}} {running - 1}',
                f"sglang:max_total_num_tokens{{{base}}} 100000",
                f"sglang:token_usage{{{base}}} {0.5 if dp == '0' else 0.25}",
                f"sglang:page_size{{{base}}} 16",
                f"sglang:scheduler_loop_batch_dispatches_total{{{base}}} {dispatches}",
                f'sglang:forward_execution_seconds_total{{{base},category="decode"}} {busy_s}',
                f'sglang:realtime_tokens_total{{{base},mode="decode"}} {decode_tokens}',
            ]
    return "\n".join(lines) + "\n"


def test_sglang_recent_labels_never_add_up_tp_ranks() -> None:
    reading = SGLANG.read(parse_exposition(_recent_sglang(100, 2.0, 500)))

    assert reading.gauges.num_running == 10 + 6  # priority="" only; one TP rank per DP rank
    assert reading.gauges.kv_capacity_tokens == 200_000  # summed over DP ranks only
    assert reading.gauges.kv_cache_usage == pytest.approx(0.375)
    assert reading.gauges.kv_cache_usage_max == pytest.approx(0.5)
    assert reading.gauges.block_size == 16
    assert reading.counters[CounterName.STEPS] == 200


def _sglang_kv(used: float, usage: float, capacity: float = 448_304, dp_rank: str | None = None) -> list[str]:
    """KV gauges of one SGLang scheduler as ``log_stats`` sets them (``token_usage`` rounded)."""
    labels = 'model_name="m"' + ("" if dp_rank is None else f',dp_rank="{dp_rank}"')
    return [
        f"sglang:num_used_tokens{{{labels}}} {used}",
        f"sglang:token_usage{{{labels}}} {usage}",
        f"sglang:max_total_num_tokens{{{labels}}} {capacity}",
    ]


def _kv_text(*lines: str) -> str:
    types = ["# TYPE sglang:num_used_tokens gauge", "# TYPE sglang:token_usage gauge"]
    return "\n".join([*types, "# TYPE sglang:max_total_num_tokens gauge", *lines]) + "\n"


def test_sglang_kv_usage_from_the_exact_token_count() -> None:
    """``token_usage`` has two decimals: 1 % of a 448k-token pool is 4,483 tokens, more than a few
    running requests hold (they read 0 % here). ``num_used_tokens`` over the pool is exact."""
    reading = SGLANG.read(parse_exposition(_kv_text(*_sglang_kv(1_500, 0.0))))

    assert reading.gauges.kv_cache_usage == pytest.approx(1_500 / 448_304)
    assert reading.gauges.kv_cache_usage_max == pytest.approx(1_500 / 448_304)
    assert reading.sources["kv_cache_usage"] == "sglang:num_used_tokens / sglang:max_total_num_tokens"
    assert reading.gauges.kv_capacity_tokens == 448_304


def test_sglang_kv_usage_per_dp_rank_and_when_the_ratio_is_not_the_gauge() -> None:
    two_ranks = _kv_text(*_sglang_kv(30_000, 0.3, 100_000, "0"), *_sglang_kv(12_345, 0.12, 100_000, "1"))
    g = SGLANG.read(parse_exposition(two_ranks)).gauges
    assert g.kv_cache_usage == pytest.approx((0.3 + 0.12345) / 2)
    assert g.kv_cache_usage_max == pytest.approx(0.3)

    # A hybrid model's usage is the fullest of its pools, not this ratio: the gauge is kept.
    hybrid = SGLANG.read(parse_exposition(_kv_text(*_sglang_kv(10_000, 0.4, 100_000))))
    assert hybrid.gauges.kv_cache_usage == pytest.approx(0.4)
    assert hybrid.sources["kv_cache_usage"] == "sglang:token_usage"
    # Without the pool's size (~v0.4's real scrape) nothing changes: usage is the gauge.
    real = SGLANG.read(parse_exposition(fixture_text(SGLANG_SAMPLE)))
    assert real.gauges.kv_cache_usage == pytest.approx(0.28)


def test_sglang_recent_step_counters_give_steps_and_step_time() -> None:
    builder = SnapshotBuilder("sg-2", SGLANG)
    builder.observe_text(_recent_sglang(100, 2.0, 500), 0.0)
    snap = builder.observe_text(_recent_sglang(160, 2.9, 1400), 3.0)

    assert snap.steps_per_s == pytest.approx(2 * 60 / 3.0)
    assert snap.step_time_mean_s == pytest.approx(0.9 / 60)
    assert snap.generation_tokens_per_s == pytest.approx(2 * 900 / 3.0)
    assert dict(snap.sources)["generation_tokens"] == "sglang:realtime_tokens_total"


# -- detection ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "engine"),
    [
        (fixture_text(REAL_032), "vllm"),
        (fixture_text(REAL_V0_010), "vllm"),
        (fixture_text(SGLANG_SAMPLE), "sglang"),
        (tgi_exposition(TgiState()), "tgi"),
    ],
    ids=["vllm-0.32", "vllm-v0", "sglang-0.4", "tgi-built"],
)
def test_engine_is_detected_from_metric_names(text: str, engine: str) -> None:
    assert detect(parse_exposition(text)) == engine


def test_process_metrics_alone_tell_no_engine() -> None:
    text = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n"
    assert detect(parse_exposition(text)) is None


def test_auto_is_not_a_dialect_and_every_dialect_has_its_prefix() -> None:
    assert AUTO not in DIALECTS
    assert {name: d.prefix for name, d in DIALECTS.items()} == {
        "vllm": "vllm:",
        "tgi": "tgi_",
        "sglang": "sglang:",
    }


def test_info_bodies_identify_their_engine() -> None:
    tgi_info: dict[str, object] = {"model_id": "m", "max_concurrent_requests": 128}
    tgi_info["router"] = "text-generation-router"
    sglang_info: dict[str, object] = {"model_path": "m", "tp_size": 1, "max_total_num_tokens": 100_000}

    assert engine_from_info("tgi", tgi_info)
    assert engine_from_info("sglang", sglang_info)
    assert not engine_from_info("tgi", sglang_info)
    assert not engine_from_info("sglang", tgi_info)
    assert not engine_from_info("tgi", {"version": "0.32.0"})  # vLLM's /version
    assert not engine_from_info("sglang", ["not", "an", "object"])


def test_sglang_idle_window_gives_no_step_estimate() -> None:
    """Old SGLang's gauges keep their last values while idle: no tokens, no steps/s estimate."""
    text = fixture_text(SGLANG_SAMPLE)
    builder = SnapshotBuilder("sg-idle", SGLANG)
    builder.observe_text(text, 0.0)
    snap = builder.observe_text(text, 5.0)

    assert snap.num_running == 162  # the stale gauge
    assert snap.generation_tokens_per_s == 0.0
    assert snap.steps_per_s is None
    assert "steps_per_s" not in dict(snap.sources)
