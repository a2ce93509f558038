"""THE SPIKE: three times a replica's capacity for a sustained period, then back to normal.

``sluice serve`` (its own process) fronts one emulated replica (its own process) whose engine
takes 4 sequences at a time (``tests/data/profiles/llama3-8b-h100-seqs4.yaml``); the test process
drives open-loop streaming load and measures every request at the client:

1. **capacity**: 4 clients back to back straight against the replica for a few seconds;
2. **warm-up** at normal load (the step model fits the replica's first scrapes);
3. **spike** at three times capacity for ``SPIKE_S`` seconds;
4. **normal** load again.

"Normal" is 0.3 x capacity: with only 4 decode slots and long outputs, a slot is free for a new
request within the TTFT target almost always at that load (Erlang C, 4 servers at 30 %
utilisation: about 3 % of arrivals wait at all). At 0.5 x about 17 % would wait, and Sluice
truthfully refuses the few whose wait would break the 600 ms target, spike or no spike, so a
"no rejection" check there would test the replica's size, not the recovery.

What must hold (issue 4, point 8): admitted requests meet their targets (p90 of client TTFT and
TPOT within target, and their p99 TTFT within target plus a small tolerance: nothing was sent that
could not meet it); rejected ones get a 429 at once (p99 under ``REJECT_P99_S``, generous for a
loaded 2-core machine); and normal service (no rejection at normal load) is back within 5 s of
the spike's end. Wall-clock margins are generous on purpose: three processes share two cores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bench.admission_load import Phase, Result, closed_loop_throughput, open_loop, quantile
from gateway.admission.config import INTERACTIVE_STALL_BUDGET_HORIZON
from tests.integration.admission.conftest import (
    MODEL,
    Running,
    gateway_config,
    start_emulator,
    start_gateway,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: Normal load, as a fraction of capacity.
NORMAL_LOAD = 0.3
TTFT_TARGET_S = 0.6
TPOT_TARGET_S = 0.025
WARMUP_S = 6.0
SPIKE_S = 25.0
NORMAL_S = 12.0
#: Normal service must be back this long after the spike ends (the issue's 5 s).
RECOVERY_S = 5.0
#: A rejection is answered within this at the 99th percentile (measured at the client).
REJECT_P99_S = 0.1
#: Slack on "nothing sent that cannot meet its target": the p99 of admitted TTFT.
TTFT_P99_TOLERANCE = 1.25
ADMISSION = {
    "classes": {
        "interactive": {
            "ttft_target_s": TTFT_TARGET_S,
            "tpot_target_s": TPOT_TARGET_S,
            "max_queue_wait_s": 0.4,
            "queue_capacity": 64,
            # The built-in interactive class's per-stream stall budget (a class map given in the
            # configuration replaces the built-in classes, so it is set here as shipped).
            "stall_budget_horizon": INTERACTIVE_STALL_BUDGET_HORIZON,
        },
    },
    "default_class": "interactive",
}


@dataclass
class Run:
    capacity_per_s: float
    results: list[Result]
    spike_end: float


@pytest.fixture(scope="module")
def spike(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    emulator = start_emulator()
    gateway: Running | None = None
    try:
        capacity = asyncio.run(closed_loop_throughput(emulator.url, MODEL, concurrency=4, duration_s=5.0))
        gateway = start_gateway(tmp_path_factory.mktemp("spike"), gateway_config(emulator.url, ADMISSION))
        phases = [
            Phase("warmup", NORMAL_LOAD * capacity, WARMUP_S),
            Phase("spike", 3.0 * capacity, SPIKE_S),
            Phase("normal", NORMAL_LOAD * capacity, NORMAL_S),
        ]
        results = asyncio.run(open_loop(gateway.url, MODEL, phases, seed=7))
        spike_sent = [r.sent_at for r in results if r.phase == "spike"]
        run = Run(capacity, results, max(spike_sent))
        _print_summary(run)
        yield run
    finally:
        for r in (gateway, emulator):
            if r is not None:
                r.proc.stop()
                print(f"--- {r.proc.name} log (tail) ---\n{r.proc.output()[-3000:]}")


def _print_summary(run: Run) -> None:
    print(f"\ncapacity {run.capacity_per_s:.1f} req/s (4 clients straight at the replica)")
    for phase in ("warmup", "spike", "normal"):
        rs = [r for r in run.results if r.phase == phase]
        ok = [r for r in rs if r.status == 200]
        rejected = [r for r in rs if r.status == 429]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
        answer = [r.answer_s for r in rejected if r.answer_s is not None]
        print(
            f"{phase:7s} sent {len(rs):4d} admitted {len(ok):4d} rejected {len(rejected):4d} "
            f"other {len(rs) - len(ok) - len(rejected):3d} | TTFT p50 {quantile(ttft, 0.5) * 1e3:6.1f} "
            f"p90 {quantile(ttft, 0.9) * 1e3:6.1f} p99 {quantile(ttft, 0.99) * 1e3:6.1f} max "
            f"{max(ttft, default=float('nan')) * 1e3:6.1f} ms | TPOT p90 {quantile(tpot, 0.9) * 1e3:5.1f} ms "
            f"| 429 p50 {quantile(answer, 0.5) * 1e3:5.1f} p99 {quantile(answer, 0.99) * 1e3:5.1f} ms"
        )
    errors = [
        r.ttft_s / (float(r.headers["x-sluice-predicted-ttft-ms"]) / 1e3) - 1.0
        for r in run.results
        if r.status == 200
        and r.ttft_s is not None
        and r.headers.get("x-sluice-predicted-ttft-ms")
        and r.phase == "spike"
    ]
    print(
        "spike: client TTFT / predicted - 1: "
        + " ".join(f"p{int(q * 100)} {quantile(errors, q):+.2f}" for q in (0.1, 0.5, 0.9, 0.99))
    )
    reasons: dict[str, int] = {}
    for r in run.results:
        if r.status != 200:
            key = f"{r.status}:{r.headers.get('x-sluice-admission-reason', r.error)}"
            reasons[key] = reasons.get(key, 0) + 1
    print(f"not admitted by reason: {reasons}")


def _measured(run: Run) -> list[Result]:
    """Requests after the warm-up (the fit has seen a few scrapes by then)."""
    return [r for r in run.results if r.phase != "warmup"]


def test_every_request_was_answered(spike: Run) -> None:
    statuses = {r.status for r in spike.results}
    assert statuses <= {200, 429}, statuses
    assert all(r.error is None for r in spike.results), [r.error for r in spike.results if r.error][:5]


def test_the_spike_was_an_overload_and_shed(spike: Run) -> None:
    during = [r for r in spike.results if r.phase == "spike"]
    admitted = [r for r in during if r.status == 200]
    # Three times capacity: about two thirds must be turned away, and the replica kept busy.
    assert len(admitted) <= 0.6 * len(during)
    assert len(admitted) >= 0.5 * spike.capacity_per_s * SPIKE_S


def test_admitted_requests_meet_their_targets(spike: Run) -> None:
    admitted = [r for r in _measured(spike) if r.status == 200]
    ttft = [r.ttft_s for r in admitted if r.ttft_s is not None]
    tpot = [r.tpot_s for r in admitted if r.tpot_s is not None]
    assert len(ttft) == len(admitted)
    assert len(admitted) >= 50
    assert quantile(ttft, 0.9) <= TTFT_TARGET_S
    assert quantile(tpot, 0.9) <= TPOT_TARGET_S
    # Nothing was sent that could not meet its target (a little slack for a loaded machine).
    assert quantile(ttft, 0.99) <= TTFT_TARGET_S * TTFT_P99_TOLERANCE


def test_rejections_are_answered_at_once(spike: Run) -> None:
    rejected = [r for r in spike.results if r.status == 429]
    assert rejected
    answer = [r.answer_s for r in rejected if r.answer_s is not None]
    assert quantile(answer, 0.99) <= REJECT_P99_S
    for r in rejected:
        assert r.headers["x-sluice-admission"] == "rejected"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert int(r.headers["retry-after-ms"]) <= 60_000


def test_normal_service_resumes_within_five_seconds(spike: Run) -> None:
    after = [r for r in spike.results if r.phase == "normal" and r.sent_at >= spike.spike_end + RECOVERY_S]
    assert len(after) >= 10
    assert [r.status for r in after if r.status != 200] == []
