"""``predicted_output_tokens``: the output a reservation is charged for is the prediction a forecast
of the request would assume (``Forecast.output_tokens_used``), capped by ``max_tokens``, times its
choices, whether the request has a cap (the memoised ``expected_output`` path) or not (the
forecast itself), before and after the service learned output lengths."""

from __future__ import annotations

import json
import math

import pytest

from gateway.api.openai import ParsedRequest, parse_request
from gateway.prediction.service import PredictionService
from gateway.tenants.pricing import predicted_output_tokens

MODEL = "m"


def parsed(max_tokens: int | None, n: int = 1) -> ParsedRequest:
    body: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 30}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if n != 1:
        body["n"] = n
    return parse_request("chat", json.dumps(body).encode())


def forecast_based(service: PredictionService, request: ParsedRequest, tenant: str, prompt: int) -> int:
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
        pytest.param(((None, [40] * 60), ("acme", [3] * 60)), id="tenant-lengths"),
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
        got = predicted_output_tokens(service, request, "acme", prompt)
        assert got == forecast_based(service, request, "acme", prompt)
        assert got >= n
        if max_tokens is not None:
            assert got <= max_tokens * n


def test_a_newly_learned_length_changes_the_charge_at_once() -> None:
    """The memoised prediction follows what the service learns (no stale charge)."""
    service = PredictionService()
    request = parsed(1000)
    learn(service, "acme", [900] * 60)
    long = predicted_output_tokens(service, request, "acme", 10)
    learn(service, "acme", [5] * 400)
    short = predicted_output_tokens(service, request, "acme", 10)
    assert short < long
    assert short == forecast_based(service, request, "acme", 10)
