"""Snapshot -> WindowStats, and in-flight list + snapshot -> ReplicaState (the step in progress)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest

from gateway.prediction.state import (
    GaugeMeans,
    Limits,
    Load,
    replica_state,
    step_in_progress,
    window_stats,
)
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import StepModel, StepParams

# 10 ms per step plus 10 us per token through the GEMMs: easy numbers by hand.
MODEL = StepModel(StepParams(0.010, 0.0, 0.0, 1e-5, 0.0, 0.0, knee_tokens=0.0))
GAUGES = GaugeMeans(running=12.0, waiting=2.0, kv_tokens=30_000.0, busy=True)
BUCKETS = ((16.0, 50.0), (1024.0, 90.0), (math.inf, 100.0))
SNAPSHOT = ReplicaSnapshot(
    name="r0",
    taken_at=100.0,
    metrics_at=100.0,
    window_s=10.0,
    num_running=12,
    num_waiting=2,
    kv_cache_usage=0.25,
    kv_capacity_tokens=120_000,
    prompt_tokens_per_s=5000.0,
    computed_prompt_tokens_per_s=4000.0,
    generation_tokens_per_s=600.0,
    steps_per_s=50.0,
    mean_tokens_per_step=92.0,
    tokens_per_step_buckets=BUCKETS,
    itl_mean_s=0.02,
    ttft_mean_s=0.3,
    mean_prompt_tokens_per_request=900.0,
)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, {"prompt_tokens_per_s": 4000.0, "steps_per_s": 50.0, "tokens_per_step_buckets": BUCKETS}),
        ({"computed_prompt_tokens_per_s": None}, {"prompt_tokens_per_s": 5000.0}),
        ({"computed_prompt_tokens_per_s": None, "prompt_tokens_per_s": None}, {"prompt_tokens_per_s": 0.0}),
        ({"itl_mean_s": None}, {"mean_itl_s": None}),
        ({"stale": True}, None),
        ({"window_s": 0.0}, None),
        ({"steps_per_s": None}, None),
    ],
    ids=[
        "computed-prompt-tokens",
        "all-prompt-tokens-without-the-split",
        "no-prompt-counter",
        "no-itl-samples",
        "stale",
        "one-scrape-only",
        "no-iteration-histogram",
    ],
)
def test_window_stats_from_a_snapshot(changes: dict[str, object], expected: dict[str, object] | None) -> None:
    got = window_stats(dataclasses.replace(SNAPSHOT, **changes), GAUGES)  # type: ignore[arg-type]
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.at_s, got.window_s, got.running, got.waiting) == (100.0, 10.0, 12.0, 2.0)
    assert (got.kv_tokens_in_use, got.generation_tokens_per_s, got.busy) == (30_000.0, 600.0, True)
    assert (got.mean_ttft_s, got.mean_prompt_tokens, got.mean_tokens_per_step) == (0.3, 900.0, 92.0)
    for name, value in {"mean_itl_s": 0.02, **expected}.items():
        assert getattr(got, name) == value, name


def flight(rid: str, prompt: int, streamed: int, started: float, last: float | None = None) -> InFlight:
    return InFlight(rid, prompt, streamed, started, 1000, last)


DECODES = [flight(f"d{i}", 100, 5, 0.0, 1.0) for i in range(10)]  # 10 decodes, 1050 KV tokens


@pytest.mark.parametrize(
    ("decoding", "pending", "boundary", "now", "budget", "remaining", "completed", "partial", "later"),
    [
        ([], [], 1.0, 1.004, 8192, 0.0, (), (), ()),
        (DECODES, [], 1.0, 1.004, 8192, 0.0061, (), (), ()),
        # Arrived during the previous step: prefilled in this one (10 ms + 1010 tokens x 10 us).
        (DECODES, [flight("p", 1000, 0, 0.995)], 1.0, 1.004, 8192, 0.0161, ("p",), (), ()),
        # Asked at the boundary itself: the step starting now is being scheduled, a newcomer
        # joins it behind "p" (which it prefills), and nothing is under way to wait for.
        (DECODES, [flight("p", 1000, 0, 0.995)], 1.0, 1.0, 8192, 0.0, (), (), ("p",)),
        # Arrived during the step: waits for the next one with the newcomer.
        (DECODES, [flight("p", 1000, 0, 1.002)], 1.0, 1.004, 8192, 0.0061, (), (), ("p",)),
        # Idle engine woken by an arrival at 1.000: its step started then.
        ([], [flight("p", 1000, 0, 1.0)], 0.5, 1.005, 8192, 0.015, ("p",), (), ()),
        # 1000 tokens at 512 per step: a silent first step (15.12 ms), then the rest (14.88 ms).
        ([], [flight("p", 1000, 0, 1.0)], 0.5, 1.020, 512, 0.010, ("p",), (), ()),
        # The same 1000 tokens seen during the first chunk: it stays partial after that step.
        ([], [flight("p", 1000, 0, 1.0)], 0.5, 1.005, 512, 0.01012, (), (("p", 512),), ()),
        # 3000 tokens at 1024 per step behind 10 decodes, arrived 30 ms before the last token:
        # one 1014-token chunk (20.24 ms) fits before it, the step in progress takes the next.
        (DECODES, [flight("p", 3000, 0, 0.97)], 1.0, 1.004, 1024, 0.01624, (), (("p", 2028),), ()),
        # Unknown phase: half a decode step, nothing assumed under way.
        (DECODES, [flight("p", 1000, 0, 0.9)], None, 1.004, 8192, 0.00505, (), (), ("p",)),
    ],
    ids=[
        "idle",
        "decode-step",
        "prefill-in-this-step",
        "at-the-boundary",
        "arrived-during-the-step",
        "idle-then-woken",
        "chunked-second-step",
        "chunked-first-step",
        "chunks-before-the-last-token",
        "unknown-phase",
    ],
)
def test_step_in_progress(
    decoding: list[InFlight],
    pending: list[InFlight],
    boundary: float | None,
    now: float,
    budget: int,
    remaining: float,
    completed: tuple[str, ...],
    partial: tuple[tuple[str, int], ...],
    later: tuple[str, ...],
) -> None:
    got = step_in_progress(
        decoding, pending, last_boundary=boundary, now=now, model=MODEL, budget=budget, max_num_seqs=256
    )
    assert got.remaining_s == pytest.approx(remaining, abs=1e-9)
    assert tuple(r.request_id for r in got.completed) == completed
    assert tuple((r.request_id, done) for r, done in got.partial) == partial
    assert tuple(r.request_id for r in got.later) == later


@pytest.mark.parametrize(
    ("first_token_at", "done"),
    [(None, 2026), (0.96, 2026), (0.99, 1013)],
    ids=["unknown", "before-it-arrived", "after-it-arrived"],
)
def test_a_long_prompt_starts_after_the_prompts_dispatched_before_it(
    first_token_at: float | None, done: int
) -> None:
    # As "chunks-before-the-last-token" above (3000 tokens at 1024 per step behind 10 decodes,
    # arrived at 0.97), with one more request "q" dispatched just before it (0.965). When q's
    # first token came at 0.99, q's prefill held the engine until then: the step that ended at
    # 0.99 gave "p" at most its leftover, which is not counted, and no whole 1013-token chunk
    # (20.2 ms) fits between 0.99 and the last token at 1.0; the step in progress takes one.
    q = InFlight("q", 100, 2, 0.965, 1000, 1.0, first_token_at)
    got = step_in_progress(
        [*DECODES, q],
        [flight("p", 3000, 0, 0.97)],
        last_boundary=1.0,
        now=1.004,
        model=MODEL,
        budget=1024,
        max_num_seqs=256,
    )
    ((request, progress),) = got.partial
    assert request.request_id == "p"
    assert progress == done  # 11 decodes leave 1013 tokens a step


LIMITS = Limits(kv_capacity_tokens=1000, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)


def rest(generated: Sequence[int], max_tokens: Sequence[int | None]) -> list[float]:
    return [50.0] * len(generated)


@pytest.mark.parametrize(
    ("engine_running", "at_scrape", "foreign"),
    [(3, 3, 0), (5, 2, 3), (None, 0, 0)],
    ids=["only-ours", "three-from-other-clients", "never-scraped"],
)
def test_other_clients_requests_come_from_the_scrape(
    engine_running: int | None, at_scrape: int, foreign: int
) -> None:
    ours = [flight("a", 100, 3, 0.0, 1.0), flight("b", 120, 1, 0.0, 1.0), flight("c", 80, 0, 1.001)]
    snapshot = dataclasses.replace(
        SNAPSHOT,
        num_running=engine_running,
        num_waiting=0,
        kv_cache_usage=0.5,
        kv_capacity_tokens=1000,
        in_flight=tuple(ours[:at_scrape]),
    )
    state = replica_state(
        ours,
        snapshot,
        limits=LIMITS,
        load=Load(prefill_tokens_per_step=40.0, prefill_share=0.2, finish_rate_per_s=3.0),
        remaining=rest,
        stale=False,
        model=MODEL,
        now=1.002,
        last_boundary=1.0,
    )
    # a and b decode (and get a token at the end of the step in progress); c waits for the next.
    assert state.decode_seqs == 2 + foreign
    assert (state.num_waiting, state.queued_prefill_tokens) == (1, 80)
    if foreign and engine_running:
        # Each of ours holds prompt + tokens so far + the one the step in progress gives it.
        assert state.kv_tokens_in_use == 104 + 122 + foreign * math.ceil(500 / engine_running)
    assert (state.prefill_share, state.finish_rate_per_s) == (0.2, 3.0)
    assert state.background_prefill_tokens_per_step == 40.0
    assert state.step_remaining_s > 0.0


def test_a_waiting_prompt_prefills_only_what_its_prefix_cache_hit_leaves() -> None:
    """A request admission expected to hit the prefix cache waits with its uncached tokens only."""
    ours = [
        flight("a", 100, 3, 0.0, 1.0),
        dataclasses.replace(flight("c", 5000, 0, 1.001), cached_tokens=4096),
        dataclasses.replace(flight("d", 300, 0, 1.0015), cached_tokens=9999),  # more than its prompt
    ]
    state = replica_state(
        ours,
        dataclasses.replace(SNAPSHOT, num_running=1, num_waiting=0, in_flight=tuple(ours[:1])),
        limits=LIMITS,
        load=Load(),
        remaining=rest,
        stale=False,
        model=MODEL,
        now=1.002,
        last_boundary=1.0,
    )
    assert (state.num_waiting, state.queued_prefill_tokens) == (2, 904 + 1)


def pinned(rid: str, prompt: int, streamed: int, started: float, output: int | None) -> InFlight:
    """A request whose client pinned its output to ``output`` (``None``: not pinned)."""
    return dataclasses.replace(
        flight(rid, prompt, streamed, started, 1.0 if streamed else None), exact_output_tokens=output
    )


@pytest.mark.parametrize(
    ("outputs", "foreign", "schedule"),
    [
        # Two decoding (5 tokens so far, 1 more at the step in progress) hold their slots for
        # 200 - 6 and 40 - 6 steps; the waiting one (30) takes the one freed at 34: 64.
        ((200, 40, 30), 0, (64.0, 194.0)),
        ((200, None, 30), 0, ()),  # one output not known
        ((200, 40, None), 0, ()),  # the waiting one's not known
        ((200, 40, 30), 1, ()),  # another client's request on the replica: its output not known
    ],
    ids=["all-pinned", "a-decode-not-pinned", "a-waiting-one-not-pinned", "another-clients"],
)
def test_pinned_outputs_give_the_slots_schedule(
    outputs: tuple[int | None, int | None, int | None], foreign: int, schedule: tuple[float, ...]
) -> None:
    ours = [
        pinned("a", 100, 5, 0.0, outputs[0]),
        pinned("b", 100, 5, 0.0, outputs[1]),
        pinned("c", 100, 0, 1.001, outputs[2]),
    ]
    snapshot = dataclasses.replace(
        SNAPSHOT, num_running=2 + foreign, num_waiting=1, kv_capacity_tokens=1000, in_flight=tuple(ours)
    )
    state = replica_state(
        ours,
        snapshot,
        limits=dataclasses.replace(LIMITS, max_num_seqs=2 + foreign),
        load=Load(),
        remaining=rest,
        stale=False,
        model=MODEL,
        now=1.002,
        last_boundary=1.0,
    )
    assert state.num_waiting == 1
    assert state.slot_steps == schedule
    if schedule:  # a pinned output is what it runs to: 200 - 6 steps to go, not the predicted 50
        assert state.release_steps == (34.0, 194.0)
