"""``reserved_output``: the output a tenant's reservation holds for a request the engine sized is
the prediction a forecast of it would assume (``Forecast.output_tokens_used``), capped by
``max_tokens``, times its choices, with a cap or without, before and after the service learned
output lengths (per tenant, with the model's fleet prior for a tenant that has too few)."""

from __future__ import annotations

import json
import math
import random

import pytest

from gateway.admission import AdmissionSettings
from gateway.admission.budget import reserved_output
from gateway.admission.engine import AdmissionEngine
from gateway.api.openai import ParsedRequest, parse_request
from gateway.prediction.service import PredictionService
from tests.unit.admission.test_policies import Fleet, new_entry

MODEL = "m"


def parsed(max_tokens: int | None, n: int = 1) -> ParsedRequest:
    body: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 30}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if n != 1:
        body["n"] = n
    return parse_request("chat", json.dumps(body).encode())


def reserved(service: PredictionService, request: ParsedRequest, prompt: int) -> int:
    """What the engine reserves for ``request`` with a prompt of ``prompt`` tokens."""
    engine = AdmissionEngine(
        AdmissionSettings(), Fleet(["r1"]), service, rng=random.Random(1), new_entry=new_entry
    )
    sized = engine.request(
        "a",
        request.model,
        prompt_tokens=prompt,
        max_tokens=request.max_tokens,
        request_class="interactive",
        arrival_s=0.0,
        tenant="acme",
        choices=request.choices,
    )
    return reserved_output(sized)


def forecast_based(
    service: PredictionService, request: ParsedRequest, tenant: str | None, prompt: int
) -> int:
    """The charge as the forecast of a request on no replica states it (the reference)."""
    forecast = service.forecast(
        "",
        model=request.model,
        tenant=tenant,
        prompt_tokens=prompt,
        max_tokens=request.max_tokens,
        in_flight=(),
        now=0.0,
    )
    output = forecast.output_tokens_used
    if not math.isfinite(output):
        return max(request.max_tokens or 1, 1) * request.choices
    return max(math.ceil(output), 1) * request.choices


def learn(service: PredictionService, tenant: str | None, lengths: list[int]) -> None:
    for length in lengths:
        service.on_finished(
            replica="r1",
            model=MODEL,
            tenant=tenant,
            prompt_chars=None,
            prompt_tokens=None,
            completion_tokens=length,
        )


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16, 100, 4096, None])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(
    "history",
    [
        pytest.param((), id="prior"),
        pytest.param(((None, [40] * 60),), id="model-lengths"),
        pytest.param(((None, [0] * 60),), id="empty-answers"),
    ],
)
def test_the_charge_is_the_forecasts_output(
    max_tokens: int | None, n: int, history: tuple[tuple[str | None, list[int]], ...]
) -> None:
    service = PredictionService()
    for tenant, lengths in history:
        learn(service, tenant, lengths)
    request = parsed(max_tokens, n)
    for prompt in (1, 50, 3000):
        got = reserved(service, request, prompt)
        assert got == forecast_based(service, request, "acme", prompt)
        assert got >= n
        if max_tokens is not None:
            assert got <= max_tokens * n


def test_a_newly_learned_length_changes_the_charge_at_once() -> None:
    """The memoised prediction follows what the service learns (no stale charge)."""
    service = PredictionService()
    request = parsed(1000)
    learn(service, "acme", [900] * 60)
    long = reserved(service, request, 10)
    learn(service, "acme", [5] * 400)
    short = reserved(service, request, 10)
    assert short < long
    assert short == forecast_based(service, request, "acme", 10)
