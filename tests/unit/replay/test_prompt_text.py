"""Prompts sent as text in the replay: sized by the gateway from their characters, as live.

``FleetConfig.text`` gives each request a character count (its true tokens times a ratio drawn
for it); ``SluicePolicy`` judges the request at the prediction service's estimate for those
characters and teaches the service the true count when the request ends, the live path
(``gateway.admission.sizing.prompt_size_of``, ``AdmissionEngine.finish``).
"""

from __future__ import annotations

import statistics

import pytest

from bench.goodput.core import FACTS, PROFILE, TARGETS, admission_settings
from gateway.admission import Decision
from replay import FleetConfig, GatewayRequest, PromptText, TraceRequest, gateway_requests, run_gateway_replay
from replay.policies import SluicePolicy
from simulator.profile import load_profile


class _Sizes(SluicePolicy):
    """Sluice's policy, recording the prompt size each decision judged (by request index)."""

    def __init__(self) -> None:
        super().__init__(admission_settings(()), seed=0)
        self.judged: dict[int, int] = {}

    def on_decision(self, request: GatewayRequest, decision: Decision, now: float) -> None:
        self.judged[request.index] = self._sized(request)


def _trace(n: int = 400) -> list[TraceRequest]:
    return [TraceRequest(i * 0.05, 200 + (i * 37) % 800, 20) for i in range(n)]


def test_characters_are_drawn_per_request_around_the_median_ratio() -> None:
    text = PromptText(chars_per_token=4.0, spread=0.2, seed=3)
    ratios = [text.chars(i, 1000) / 1000 for i in range(2000)]
    assert text.chars(7, 1000) == text.chars(7, 1000)
    assert PromptText(seed=4).chars(7, 1000) != text.chars(7, 1000)
    assert statistics.median(ratios) == pytest.approx(4.0, rel=0.03)
    assert 0.15 < statistics.stdev([r / 4.0 for r in ratios]) < 0.25
    assert PromptText(chars_per_token=3.0, spread=0.0).chars(1, 100) == 300
    assert PromptText(spread=0.0).chars(1, 0) == 1
    with pytest.raises(ValueError, match="chars_per_token"):
        PromptText(chars_per_token=0.0)


def test_requests_carry_characters_only_when_sent_as_text() -> None:
    profile = load_profile(PROFILE)
    exact = gateway_requests(_trace(10), FleetConfig(profile, FACTS))
    text = gateway_requests(_trace(10), FleetConfig(profile, FACTS, text=PromptText(seed=1)))
    assert not any(r.sized_from_text for r in exact)
    assert all(r.sized_from_text for r in text)
    assert [r.prompt_tokens for r in text] == [r.prompt_tokens for r in exact]
    assert [r.prompt_chars for r in text] == [
        PromptText(seed=1).chars(i, t.prompt_tokens) for i, t in enumerate(_trace(10))
    ]


def test_sluice_judges_text_prompts_at_its_learned_ratio() -> None:
    text = PromptText(chars_per_token=3.0, spread=0.2, seed=2)
    config = FleetConfig(load_profile(PROFILE), FACTS, replicas=1, tenants=2, text=text)
    policy = _Sizes()
    run_gateway_replay(_trace(), config, policy, targets=TARGETS)
    assert len(policy.judged) == 400
    requests = {r.index: r for r in gateway_requests(_trace(), config)}
    # Before anything has finished the service knows no ratio for the model: 4 characters a token.
    first_chars = requests[0].prompt_chars
    assert first_chars is not None
    assert policy.judged[0] == pytest.approx(first_chars / 4.0, rel=0.01)
    # Once it has learned the fleet's ratio (3), each estimate is off by that request's own draw
    # only: median error near zero, most within the draw's spread.
    errors = [policy.judged[i] / requests[i].prompt_tokens - 1.0 for i in range(200, 400)]
    assert abs(statistics.median(errors)) < 0.05, statistics.median(errors)
    assert sum(abs(e) < 0.5 for e in errors) >= 0.9 * len(errors)
    assert any(abs(e) > 0.05 for e in errors)  # sized from text, not read off the trace
    # Each tenant learned its own ratio, near 3; the fleet prior a request of no tenant (or a new
    # tenant) is sized at is their median with the 4 characters a token prior: near 3 too.
    for tenant in {r.tenant for r in requests.values()}:
        assert policy.service.estimate_prompt_tokens(policy.route, 3000, tenant) == pytest.approx(
            1000, rel=0.15
        )
    assert policy.service.estimate_prompt_tokens(policy.route, 3000) == pytest.approx(1000, rel=0.15)
