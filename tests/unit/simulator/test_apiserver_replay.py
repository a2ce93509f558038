"""API-server costs in the replay's virtual time (``replay.loop.VirtualTimeLoop``): the gateway
measures TTFTs and token gaps larger by exactly the modelled work, with the costs carried by
``FleetConfig.profile`` as the live emulator carries them in its profile."""

from __future__ import annotations

import pytest

from gateway.prediction import ReplicaFacts
from replay.loop import Fleet, IdleHooks, VirtualTimeLoop
from replay.requests import FleetConfig, GatewayRequest, Outcome, gateway_requests
from replay.traces import TraceRequest
from simulator.apiserver import ApiServerCosts
from simulator.costmodel import CostModel, StepShape
from simulator.engine import FinishedRequestStats
from simulator.profile import Profile, load_profile

BASE = load_profile("llama3-8b-h100")
MODEL = CostModel(BASE)
REQ_S, PROMPT_S, OUT_S = 0.02, 3e-5, 1e-3


class DispatchAll(IdleHooks):
    """Sends every request to replica 0 the moment it arrives (no admission, no scrapes)."""

    name = "dispatch all"
    prediction_service = None

    def bind(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        self.fleet.dispatch(request, 0, now)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        return None


def replay(profile: Profile, trace: list[TraceRequest]) -> list[Outcome]:
    config = FleetConfig(profile, ReplicaFacts(), replicas=1, jitter=0.0, max_tokens=64)
    loop = VirtualTimeLoop(config, DispatchAll())
    requests = gateway_requests(trace, config)
    loop.run(requests, [t.output_tokens for t in trace], lambda: False)
    return [loop.outcome(r.index) for r in requests]


def with_costs(contention: str) -> Profile:
    return BASE.with_api_server(
        ApiServerCosts(
            per_request_s=REQ_S, per_prompt_token_s=PROMPT_S, per_output_token_s=OUT_S, contention=contention
        )
    )


#: Requests far enough apart that each finds the engine idle.
SPACED = [
    TraceRequest(2.0 * i, prompt, out) for i, (prompt, out) in enumerate([(100, 8), (700, 8), (2000, 8)])
]


@pytest.mark.parametrize("contention", ["shared", "separate"])
def test_ttft_on_an_idle_engine_grows_by_the_tokenisation(contention: str) -> None:
    off = replay(BASE, SPACED)
    on = replay(with_costs(contention), SPACED)
    for a, b, t in zip(off, on, SPACED, strict=True):
        assert a.ttft_s is not None
        assert b.ttft_s is not None
        assert a.ttft_s == pytest.approx(MODEL.step_time_s(StepShape(prefill_chunks=((t.prompt_tokens, 0),))))
        assert b.ttft_s - a.ttft_s == pytest.approx(REQ_S + PROMPT_S * t.prompt_tokens, abs=1e-9)


def test_shared_cpu_adds_the_framing_of_each_token_to_the_next_step() -> None:
    off = replay(BASE, SPACED)
    on = replay(with_costs("shared"), SPACED)
    for a, b in zip(off, on, strict=True):
        assert a.tpot_s is not None
        assert b.tpot_s is not None
        # One stream: every decode step after the first token waits for one token's framing.
        assert b.tpot_s - a.tpot_s == pytest.approx(OUT_S, abs=1e-9)
        # busy time counts the API server's work on the engine's CPU.
        assert b.busy_s - a.busy_s == pytest.approx(
            REQ_S + PROMPT_S * b.prompt_tokens + OUT_S * (b.output_tokens - 1), abs=1e-9
        )


def test_separate_core_leaves_token_gaps_alone() -> None:
    off = replay(BASE, SPACED)
    on = replay(with_costs("separate"), SPACED)
    for a, b in zip(off, on, strict=True):
        assert b.tpot_s == pytest.approx(a.tpot_s, abs=1e-12)


def test_a_burst_waits_for_every_prompt_before_it_on_the_shared_cpu() -> None:
    burst = [TraceRequest(0.0, 300, 4) for _ in range(5)]
    off = replay(BASE, burst)
    on = replay(with_costs("shared"), burst)
    intake = REQ_S + PROMPT_S * 300
    # The first arrival starts the idle engine: it is tokenised and prefilled alone. The other
    # four are tokenised before the next step (which also waits for the framing of the first's
    # token), then prefilled together in it, as without costs.
    assert on[0].ttft_s is not None
    assert off[0].ttft_s is not None
    assert on[0].ttft_s - off[0].ttft_s == pytest.approx(intake, abs=1e-9)
    for a, b in zip(off[1:], on[1:], strict=True):
        assert a.first_token_s == off[1].first_token_s
        assert b.ttft_s is not None
        assert a.ttft_s is not None
        assert b.ttft_s - a.ttft_s == pytest.approx(intake + 4 * intake + OUT_S, abs=1e-9)


def test_a_burst_is_tokenised_one_at_a_time_on_a_separate_core() -> None:
    burst = [TraceRequest(0.0, 300, 4) for _ in range(3)]
    on = replay(with_costs("separate"), burst)
    intake = REQ_S + PROMPT_S * 300
    prefill = MODEL.step_time_s(StepShape(prefill_chunks=((300, 0),)))
    assert on[0].ttft_s == pytest.approx(intake + prefill, abs=1e-9)
    for k in (1, 2):
        # Ready after the k prompts before it; it joins the first step that starts after that.
        ready = (k + 1) * intake
        ttft = on[k].ttft_s
        assert ttft is not None
        assert ready + prefill < ttft < ready + 0.05
