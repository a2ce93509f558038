"""Hand-built replicas for admission tests: Llama-3-8B on H100 (a roofline step model), a fake clock."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    ReplicaView,
    StreamingRequest,
)
from predictor import GPUS, MODELS, Efficiency, ReplicaState, StepModel, roofline_prior, unknown_step_model

#: The step model every replica here runs: the roofline at 50 % of peak FLOP/s (the prior's
#: guess until 2026-12-01), pinned so that the scenarios' loads, worked out on it, stay put
#: whatever the prior's defaults become: these tests judge admission given a model.
MODEL = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"], efficiency=Efficiency(compute=0.5))
UNKNOWN = unknown_step_model("not calibrated yet")
#: The defaults, with forecasts taken as they are (the arithmetic below is checked exactly), and
#: the interactive class's stall budget off: these tests check the mean-TPOT rule for running
#: streams, which the budget replaces for its class (``test_stall_budget.py`` checks the budget,
#: the shipped default included).
SETTINGS = AdmissionSettings.model_validate(
    {
        "forecast_margin": 0.0,
        "classes": {
            **{n: c.model_dump() for n, c in AdmissionSettings().classes.items()},
            "interactive": {
                **AdmissionSettings().classes["interactive"].model_dump(),
                "stall_budget_horizon": None,
            },
        },
    }
)
KV_CAPACITY = 400_000
MAX_LEN = 131_072


@dataclass
class FakeClock:
    """The admission clock under test control: seconds, only moves when told."""

    now: float = 1000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def state(
    decodes: int = 0,
    context: int = 2000,
    queued: Sequence[int] = (),
    *,
    kv_capacity: int = KV_CAPACITY,
    max_num_seqs: int = 256,
    budget: int = 8192,
    max_len: int = MAX_LEN,
    mean_remaining: float = 0.0,
    stale: bool = False,
) -> ReplicaState:
    """A replica with ``decodes`` running requests of ``context`` tokens and ``queued`` prompts waiting."""
    return ReplicaState(
        num_running=decodes,
        num_waiting=len(queued),
        decode_seqs=decodes,
        kv_tokens_in_use=decodes * context,
        kv_capacity_tokens=kv_capacity,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        queued_prefill_tokens=sum(queued),
        queued_requests=len(queued),
        queued_prefill_attn_pairs=sum(p * p / 2 for p in queued),
        mean_remaining_output_tokens=mean_remaining,
        stale=stale,
    )


def streams(
    count: int,
    request_class: str = "interactive",
    *,
    tpot_s: float = 0.02,
    prompt: int = 1500,
    generated: int = 100,
    expected: float = 300.0,
) -> list[StreamingRequest]:
    """``count`` identical streams of ``request_class`` (each predicted at ``tpot_s`` per token)."""
    return [StreamingRequest(request_class, prompt, generated, expected, tpot_s) for _ in range(count)]


def view(
    name: str,
    replica: ReplicaState,
    running: Sequence[StreamingRequest] = (),
    *,
    healthy: bool = True,
    stale: bool = False,
    model: StepModel = MODEL,
) -> ReplicaView:
    return ReplicaView.build(name, healthy=healthy, model=model, state=replica, streams=running, stale=stale)


def request(
    prompt: int = 500,
    output: float = 200.0,
    *,
    request_class: str = "interactive",
    arrival: float = 1000.0,
    max_tokens: int | None = 1024,
    deadline: float | None = None,
    request_id: str = "r",
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=request_id,
        request_class=request_class,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        expected_output_tokens=output,
        arrival_s=arrival,
        output_quantile=0.9,
        deadline_s=deadline,
    )


def settings(**overrides: object) -> AdmissionSettings:
    """Default settings with top-level overrides (validated like a config file)."""
    data = SETTINGS.model_dump()
    data.update(overrides)
    return AdmissionSettings.model_validate(data)


def with_class(name: str, **fields: object) -> AdmissionSettings:
    """Default settings with one class's fields overridden."""
    data = SETTINGS.model_dump()
    data["classes"][name].update(fields)
    return AdmissionSettings.model_validate(data)


def controller(config: AdmissionSettings = SETTINGS, seed: int = 7) -> AdmissionController:
    return AdmissionController(config, rng=random.Random(seed))
