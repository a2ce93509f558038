"""The closed-loop bench's parts that need no vLLM: its client against a real aiohttp server that
streams as vLLM and Sluice do, its counts per point, and its verdicts (missing data is not met)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench.closed_loop import cli
from bench.closed_loop.client import Outcome, replay, saturate
from bench.closed_loop.core import QUICK, sluice_config_for
from bench.closed_loop.report import (
    FULL_LOADS,
    Point,
    gateway_errors,
    header_errors,
    path_stats,
    render,
    verdicts,
)
from bench.closed_loop.workload import TRACES, Arrival, prompt_text, scaled, schedule
from bench.verdicts import Status
from gateway.config.settings import Settings
from replay import Targets
from tests.support import speed

TARGETS = Targets(ttft_s=2.0, tpot_s=0.15)
EDGES = (10, 20, 30)


def outcome(
    index: int = 0,
    *,
    status: int | None = 200,
    prompt: int = 5,
    tokens: int = 4,
    ttft: float | None = 0.5,
    tpot: float | None = 0.05,
    finished: bool = True,
    predicted: tuple[float, float] | None = None,
) -> Outcome:
    return Outcome(
        index=index,
        sent_s=0.0,
        prompt_tokens=prompt,
        output_tokens=tokens,
        status=status,
        ttft_s=ttft,
        tpot_s=tpot,
        tokens=tokens if status == 200 else 0,
        finished=finished,
        predicted_ttft_s=None if predicted is None else predicted[0],
        predicted_tpot_s=None if predicted is None else predicted[1],
    )


def test_a_request_meets_its_targets_only_streamed_to_its_end_within_both() -> None:
    assert outcome().met(TARGETS)
    assert outcome(tokens=1, tpot=None).met(TARGETS)  # one token: no TPOT to miss
    assert not outcome(ttft=2.5).met(TARGETS)
    assert not outcome(tpot=0.2).met(TARGETS)
    assert not outcome(finished=False).met(TARGETS)  # cancelled mid-stream
    assert not outcome(status=429, ttft=None, tpot=None).met(TARGETS)
    assert not outcome(status=None, ttft=None, tpot=None, finished=False).met(TARGETS)


def test_path_stats_count_refusals_apart_and_unanswered_requests_as_admitted_and_missed() -> None:
    outcomes = [
        outcome(0, prompt=5),  # met, quartile 0
        outcome(1, prompt=15, ttft=3.0),  # admitted, missed, quartile 1
        outcome(2, prompt=25, status=429, ttft=None, tpot=None),  # refused, quartile 2
        outcome(3, prompt=40, status=None, ttft=None, tpot=None, finished=False),  # unanswered, quartile 3
        outcome(4, prompt=40, status=503, ttft=None, tpot=None),  # an error, quartile 3
        outcome(5, prompt=40, ttft=5.0, tpot=1e-5),  # missed; its tokens came in one burst
    ]
    s = path_stats(outcomes, TARGETS, duration_s=2.0, edges=EDGES)
    assert (s.offered, s.refused, s.errors, s.unanswered, s.met, s.admitted) == (6, 1, 1, 1, 1, 5)
    assert (s.streams, s.bursts) == (3, 1)
    assert s.good_per_s == 0.5
    assert s.good_tokens_per_s == (5 + 4) / 2.0
    assert s.refused_share == pytest.approx(1 / 6)
    assert s.admitted_attainment == 0.2
    assert s.quartile_offered == (1, 1, 1, 3)
    assert s.quartile_rates == (1.0, 1.0, 0.0, 1.0)


def test_forecast_errors_are_forecast_over_measured_minus_one() -> None:
    outcomes = [outcome(i, ttft=1.0, tpot=0.1, predicted=(0.5, 0.12)) for i in range(3)]
    burst = outcome(8, ttft=1.0, tpot=1e-5, predicted=(0.5, 0.12))  # its TPOT is the relay's
    errors = header_errors([*outcomes, burst, outcome(9, status=429, ttft=None, tpot=None)])
    assert errors["ttft"].n == 4
    assert errors["tpot"].n == 3
    assert errors["ttft"].median == pytest.approx(-0.5)
    assert errors["tpot"].median == pytest.approx(0.2)
    assert errors["tpot"].p90_abs == pytest.approx(0.2)
    assert header_errors([outcome()])["ttft"].n == 0  # no forecast header: nothing to score

    # The gateway's residuals are measured / forecast - 1: a forecast half of what was measured
    # is +100 % there, -50 % here; after the correction +0 %.
    view = {
        "replicas": [{"name": "vllm-0", "state": "healthy"}],
        "prediction": {
            "replicas": {
                "vllm-0": {
                    "correction": {
                        "ttft": {
                            "factor": 2.0,
                            "residuals": {
                                "samples": 7,
                                "before_median": 1.0,
                                "before_p90_abs": 1.5,
                                "after_median": 0.0,
                                "after_p90_abs": 0.2,
                            },
                        },
                        "tpot": {"factor": 1.0, "residuals": {"samples": 0}},
                    }
                }
            }
        },
    }
    g = gateway_errors(view, "vllm-0")
    assert g["ttft"].samples == 7
    assert g["ttft"].before_median == pytest.approx(-0.5)
    assert g["ttft"].after_median == pytest.approx(0.0)
    assert (g["ttft"].before_p90_abs, g["ttft"].after_p90_abs, g["ttft"].factor) == (1.5, 0.2, 2.0)
    assert g["tpot"].samples == 0
    assert g["tpot"].after_median is None
    assert gateway_errors({}, "vllm-0")["ttft"].samples == 0


def _points(
    load: float, *, sluice: list[Outcome], direct: list[Outcome], residual: float | None
) -> list[Point]:
    # A direct and a Sluice point at ``load``; the gateway's residual after the correction
    # (measured / forecast - 1) is ``residual`` for both latencies.
    residuals = {"samples": 5, "after_median": residual}
    correction = {m: {"residuals": residuals} for m in ("ttft", "tpot")}
    view = {"prediction": {"replicas": {"r": {"correction": correction}}}}
    return [
        Point("azure", load, "direct", 1.0, path_stats(direct, TARGETS, 10.0, EDGES)),
        Point(
            "azure",
            load,
            "sluice",
            1.0,
            path_stats(sluice, TARGETS, 10.0, EDGES),
            header_errors(sluice),
            gateway_errors(view, "r"),
        ),
    ]


def test_verdicts_judge_every_target_at_every_load_and_a_point_not_run_is_no_data() -> None:
    good = [outcome(i) for i in range(20)]
    points = _points(0.5, sluice=good, direct=good, residual=0.05)
    points += _points(
        2.0, sluice=[*good, outcome(99, status=429, ttft=None, tpot=None)], direct=good[:5], residual=None
    )
    found = {v.target: v for v in verdicts(points, ["azure", "mooncake"])}
    status = {t: v.status for t, v in found.items()}
    assert status["azure, 0.5x: admitted attainment >= 95%"] is Status.MET
    assert status["azure, 0.5x: refused <= 2%"] is Status.MET
    assert status["azure, 2x: Sluice's good tokens/s >= 90% of the best direct point"] is Status.MET
    assert status["azure, 0.5x: signed median TTFT error after the correction within +-15%"] is Status.MET
    # The forecast error is -1/(1+0.05)+1 = -4.8 %: within the band.
    assert found[
        "azure, 0.5x: signed median TPOT error after the correction within +-15%"
    ].value == pytest.approx(1 / 1.05 - 1)
    # Loads and traces not run, and a point whose gateway had no residual: not met (no data).
    assert status["azure, 4x: Sluice's good tokens/s >= 90% of the best direct point"] is Status.NO_DATA
    assert status["azure, 1x: admitted attainment >= 95%"] is Status.NO_DATA
    assert status["azure, 2x: signed median TTFT error after the correction within +-15%"] is Status.NO_DATA
    assert all(v.status is Status.NO_DATA for t, v in found.items() if t.startswith("mooncake"))
    assert len(found) == 2 * (len(FULL_LOADS) * 3 + 1 + 2)


def test_verdicts_are_not_met_when_admitted_requests_miss_or_low_load_is_refused() -> None:
    missed = [outcome(i, ttft=3.0) for i in range(10)] + [outcome(10 + i) for i in range(10)]
    refused = [outcome(i, status=429, ttft=None, tpot=None) for i in range(5)]
    points = _points(0.5, sluice=missed + refused, direct=missed, residual=0.5)
    status = {v.target: v.status for v in verdicts(points, ["azure"])}
    assert status["azure, 0.5x: admitted attainment >= 95%"] is Status.NOT_MET
    assert status["azure, 0.5x: refused <= 2%"] is Status.NOT_MET
    assert status["azure, 0.5x: signed median TTFT error after the correction within +-15%"] is Status.NOT_MET


def test_traces_are_scaled_to_the_context_and_retimed_to_the_rate() -> None:
    requests, dropped = scaled(TRACES["mooncake"], 1024)
    assert dropped > 0
    assert requests
    assert all(r.prompt_tokens + r.output_tokens <= 1024 for r in requests)
    arrivals = schedule(requests, rate_per_s=3.0, duration_s=20.0)
    assert len(arrivals) == 60
    assert [a.index for a in arrivals] == list(range(60))
    assert 0.0 == arrivals[0].at_s < arrivals[-1].at_s < 20.0
    assert prompt_text(50, 2.0, seed=1) != prompt_text(50, 2.0, seed=2)
    assert len(prompt_text(50, 2.0, seed=1)) == 100


# -- the client against a real server --------------------------------------------------------------


async def _chat(request: web.Request) -> web.StreamResponse:
    """vLLM's stream with Sluice's headers; ``max_tokens`` 1: a 429; 2: never answers."""
    body = await request.json()
    n = body["max_tokens"]
    if n == 1:
        return web.json_response(
            {"error": {"message": "no", "type": "rate_limit_error", "code": "slo"}},
            status=429,
            headers={"Retry-After": "3", "x-sluice-admission": "rejected"},
        )
    if n == 2:
        await asyncio.sleep(3600)
    resp = web.StreamResponse(
        headers={
            "content-type": "text/event-stream",
            "x-sluice-admission": "admitted",
            "x-sluice-predicted-ttft-ms": "40.0",
            "x-sluice-predicted-tpot-ms": "10.00",
        }
    )
    await resp.prepare(request)
    await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')
    for i in range(n):
        await asyncio.sleep(0.01)
        chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_replay_measures_streams_refusals_and_cancels_what_is_unanswered_after_the_grace(
    server: str,
) -> None:
    arrivals = [Arrival(0.0, 0, 8, 5), Arrival(0.05, 1, 8, 1), Arrival(0.1, 2, 8, 2)]
    grace = speed.scaled(1.0)  # the stream and the refusal are done long before; the hung one is not
    out = await replay(server, arrivals, model="m", chars_per_token=1.0, grace_s=grace, api_key="sk-x")
    streamed, refused, hung = out
    assert (streamed.status, streamed.tokens, streamed.finished) == (200, 5, True)
    assert streamed.admission == "admitted"
    assert streamed.ttft_s is not None
    assert streamed.ttft_s > 0
    assert streamed.tpot_s is not None
    assert streamed.tpot_s > 0
    assert streamed.predicted_ttft_s == pytest.approx(0.04)
    assert streamed.predicted_tpot_s == pytest.approx(0.01)
    assert (refused.status, refused.retry_after_s, refused.tokens) == (429, 3.0, 0)
    assert refused.admission == "rejected"
    assert (hung.status, hung.finished, hung.ttft_s) == (None, False, None)
    assert [o.index for o in out] == [0, 1, 2]


async def test_saturate_counts_the_streams_completed_in_its_window_and_cancels_the_rest(server: str) -> None:
    # Streams of 5 tokens (about 50 ms each) and streams that never answer, taken in turn by two
    # clients: the first stream completes, then each client ends up waiting on one that never does,
    # which is cancelled when the window closes (the call returns).
    arrivals = [Arrival(0.0, 0, 8, 5), Arrival(0.0, 1, 8, 2)]
    window = speed.scaled(1.0)
    done = await saturate(server, arrivals, model="m", chars_per_token=1.0, concurrency=2, duration_s=window)
    assert 1 <= done <= 2


def test_a_variant_is_a_path_of_its_own_in_the_tables_and_judged_by_no_verdict() -> None:
    good = [outcome(i) for i in range(20)]
    missed = [outcome(i, ttft=3.0) for i in range(20)]
    points = _points(2.0, sluice=good, direct=good, residual=0.05)
    variant = dataclasses.replace(
        points[1], path="sluice+overdue", stats=path_stats(missed, TARGETS, 10.0, EDGES)
    )
    points.append(variant)
    lines = render(points, {"azure": "Azure"})
    assert any(line.startswith("| 2x | 1.00 | sluice+overdue | 0.00 |") for line in lines), lines
    assert any(line.startswith("| 2x, sluice+overdue |") for line in lines), lines
    found = {v.target: v.status for v in verdicts(points, ["azure"])}
    assert found["azure, 2x: admitted attainment >= 95%"] is Status.MET  # Sluice's, not the variant's


def test_a_variants_settings_are_merged_into_the_shipped_configuration() -> None:
    plan = dataclasses.replace(QUICK, variants=(("overdue", {"admission": {"overdue_ttft": True}}),))
    shipped = sluice_config_for(plan)(8000, [])
    varied = sluice_config_for(plan, plan.variants[0][1])(8000, [])
    assert "overdue_ttft" not in shipped["admission"]
    assert varied["admission"] == {**shipped["admission"], "overdue_ttft": True}
    assert Settings.model_validate({**varied, "replicas": [{"name": "r", "url": "http://127.0.0.1:9"}]})


@pytest.mark.parametrize("spec", ["overdue={", "overdue=[1]", "={}"])
def test_a_variant_that_is_not_label_and_json_object_is_a_usage_error(spec: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--variant", spec])
    assert info.value.code == 2
