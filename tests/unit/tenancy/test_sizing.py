"""A request's prompt is sized once (``gateway.admission.sizing``): the tenancy middleware's estimate is the
one admission judges, and a tenant without a budget is sized by admission alone."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.sizing import prompt_tokens_of
from gateway.api.openai import ParsedRequest
from gateway.prediction.service import PredictionService
from tests.unit.tenancy.conftest import COMPLETION, KEY_A, KEY_B, Scripted, StartTenantGateway

#: A text prompt: its tokens are estimated from its characters (token ids would be exact).
TEXT = {**COMPLETION, "prompt": "Say something short. " * 4}


@pytest.mark.parametrize(
    "key", [pytest.param(KEY_A, id="tenant-with-a-budget"), pytest.param(KEY_B, id="tenant-without")]
)
async def test_the_prompt_is_sized_once_per_request(
    start_tenant_gateway: StartTenantGateway, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    calls: list[tuple[str, int]] = []
    estimate = PredictionService.estimate_prompt_tokens

    def counted(self: PredictionService, model: str, prompt_chars: int) -> int:
        calls.append((model, prompt_chars))
        return estimate(self, model, prompt_chars)

    monkeypatch.setattr(PredictionService, "estimate_prompt_tokens", counted)
    gw = await start_tenant_gateway(Scripted().answer)

    for _ in range(3):
        resp = await gw.post(key=key, body=TEXT)
        await resp.read()
        assert resp.status == 200

    assert len(calls) == 3, calls


class _Failing:
    def estimate_prompt_tokens(self, model: str, prompt_chars: int) -> int:
        raise RuntimeError("broken")


def _parsed(**fields: Any) -> ParsedRequest:
    return ParsedRequest("completions", "m", False, False, 10, {}, b"", **fields)


@pytest.mark.parametrize(
    ("parsed", "tokens"),
    [
        pytest.param(_parsed(prompt_chars=400, prompt_token_ids=37), 37, id="token-ids-exact"),
        pytest.param(_parsed(prompt_chars=0, prompt_token_ids=0), 1, id="at-least-one"),
        pytest.param(_parsed(prompt_chars=400), 100, id="service-fails-4-chars-per-token"),
    ],
)
def test_prompt_tokens_of(parsed: ParsedRequest, tokens: int) -> None:
    assert prompt_tokens_of(_Failing(), parsed) == tokens  # type: ignore[arg-type]
