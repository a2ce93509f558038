"""A request's prompt is sized once (``gateway.admission.sizing``): the tenancy middleware's estimate is the
one admission judges, and a tenant without a budget is sized by admission alone."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.sizing import PromptSize, prompt_size_of
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
    calls: list[tuple[str, int, str | None]] = []
    estimate = PredictionService.estimate_prompt_tokens

    def counted(self: PredictionService, model: str, prompt_chars: int, tenant: str | None = None) -> int:
        calls.append((model, prompt_chars, tenant))
        return estimate(self, model, prompt_chars, tenant)

    monkeypatch.setattr(PredictionService, "estimate_prompt_tokens", counted)
    gw = await start_tenant_gateway(Scripted().answer)

    for _ in range(3):
        resp = await gw.post(key=key, body=TEXT)
        await resp.read()
        assert resp.status == 200

    assert len(calls) == 3, calls
    assert {tenant for _, _, tenant in calls} == {"team-a" if key == KEY_A else "team-b"}


class _Failing:
    def estimate_prompt_tokens(self, model: str, prompt_chars: int, tenant: str | None = None) -> int:
        raise RuntimeError("broken")


def _parsed(**fields: Any) -> ParsedRequest:
    return ParsedRequest("completions", "m", False, False, 10, {}, b"", **fields)


@pytest.mark.parametrize(
    ("parsed", "size"),
    [
        pytest.param(
            _parsed(prompt_chars=400, prompt_token_ids=37), PromptSize(37, 37, True), id="token-ids-exact"
        ),
        pytest.param(_parsed(prompt_chars=0, prompt_token_ids=0), PromptSize(1, 1, True), id="at-least-one"),
        pytest.param(
            _parsed(prompt_chars=400), PromptSize(100, 25, False), id="service-fails-4-chars-per-token"
        ),
        # Several prompts: each is a sequence of its own; only the longest must fit a context.
        pytest.param(
            _parsed(prompt_chars=0, prompt_token_ids=90, longest_prompt=50),
            PromptSize(90, 50, True),
            id="token-id-lists-longest",
        ),
        pytest.param(
            _parsed(prompt_chars=400, longest_prompt=100),
            PromptSize(100, 7, False),  # the fewest 25 of all four, a quarter of it rounded up
            id="strings-longest-quarter",
        ),
    ],
)
def test_prompt_size_of(parsed: ParsedRequest, size: PromptSize) -> None:
    assert prompt_size_of(_Failing(), parsed) == size  # type: ignore[arg-type]


def test_a_prompt_is_sized_at_its_own_tenants_ratio() -> None:
    service = PredictionService()
    for _ in range(20):
        service.on_finished(
            replica="r", model="m", tenant="dense", prompt_chars=4000, prompt_tokens=2000, completion_tokens=1
        )
    parsed = _parsed(prompt_chars=12_000)
    assert prompt_size_of(service, parsed, "dense") == PromptSize(6000, 750, False)
    # Another tenant's first prompt: the fleet prior, the median of "dense" (2) and the prior (4).
    assert prompt_size_of(service, parsed, "newcomer") == PromptSize(4000, 750, False)
