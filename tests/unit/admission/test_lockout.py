"""No lock-out, ever, in virtual time: after a burst, an idle replica admits.

The replay (``replay.admission.run_gateway_replay``) runs the shipped ``AdmissionEngine``
(``replay.policies.SluicePolicy``) and ``PredictionService`` in front of the emulator's engine,
its ``/metrics`` scraped every second as live. A class sets only its two targets (no stall
budget, the default for every class but ``interactive``). A burst of long prompts saturates the
replica; then light traffic (short prompts, a few output tokens, two a second, and one-token
``"hi"`` requests) that an idle replica serves far inside the targets.

The failure this guards against: the burst's prefill share, measured from the windows'
inter-token latencies, staying in the forecast's load after the replica went idle (idle windows
have no inter-token latency to correct it, and only admitted traffic could), so that every light
request is refused on its predicted TPOT, each with a long Retry-After, for as long as the replay
runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final

from bench.goodput.core import FACTS, PROFILE
from gateway.admission import AdmissionSettings
from replay import FleetConfig, Outcome, Targets, TraceRequest, run_gateway_replay
from replay.policies import SluicePolicy
from simulator.profile import load_profile

#: The class: targets only (an H100's scale: an idle decode step of Llama-3-8B is ~8 ms).
TTFT_TARGET_S: Final = 1.0
TPOT_TARGET_S: Final = 0.02
SETTINGS: Final = AdmissionSettings.model_validate(
    {
        "classes": {"plain": {"ttft_target_s": TTFT_TARGET_S, "tpot_target_s": TPOT_TARGET_S}},
        "default_class": "plain",
    }
)
#: The burst: 3000-token prompts, 30 output tokens, 50 a second for 20 s (several times what
#: the replica can take within the targets).
BURST_S: Final = 20.0
BURST_RATE: Final = 50.0
BURST_PROMPT: Final = 3000
#: The light traffic after it: from ``LIGHT_FROM_S`` for ``LIGHT_S`` seconds, one request every
#: ``LIGHT_EVERY_S``, alternating a short prompt with 8 output tokens and a one-token "hi".
LIGHT_FROM_S: Final = BURST_S + 3.0
LIGHT_S: Final = 45.0
LIGHT_EVERY_S: Final = 0.5
#: Admission back within this long after the replica went idle (seconds).
BACK_WITHIN_S: Final = 5.0
#: Longest Retry-After (jittered, seconds) a refusal may carry when a request of its size is
#: admitted within a second of it. In the burst the forecast's drain (its TPOT stretched by the
#: share of prefill the last window measured) gives up to ~11 s while the next window's share
#: lets one in; the lock-out's 43-60 s came from a frozen share on an idle replica.
LONGEST_CONTRADICTED_S: Final = 15.0


@dataclass(frozen=True)
class Run:
    """One replay: every outcome, when the replica went idle, the Retry-After each refusal got."""

    outcomes: tuple[Outcome, ...]
    idle_at: float
    retry_after_s: dict[int, float | None]
    prefill_share: object


def _trace() -> list[TraceRequest]:
    trace = [TraceRequest(i / BURST_RATE, BURST_PROMPT, 30) for i in range(int(BURST_S * BURST_RATE))]
    n = int(LIGHT_S / LIGHT_EVERY_S)
    for i in range(n):
        at = LIGHT_FROM_S + i * LIGHT_EVERY_S
        trace.append(TraceRequest(at, 20, 8) if i % 2 == 0 else TraceRequest(at, 1, 1))
    return trace


@functools.cache
def replay() -> Run:
    """The burst and the light traffic after it, through Sluice (cached: the tests only read it)."""
    config = FleetConfig(
        load_profile(PROFILE), FACTS, replicas=1, max_tokens=8, tenants=1, jitter=0.0, seed=1
    )
    policy = SluicePolicy(SETTINGS, request_class="plain")
    result = run_gateway_replay(_trace(), config, policy, targets=Targets(TTFT_TARGET_S, TPOT_TARGET_S))
    burst = [o for o in result.outcomes if o.arrival_s < BURST_S]
    assert any(o.rejected for o in burst), "the burst must saturate the replica"
    # The replica goes idle when the last burst request it took has finished.
    idle_at = max(o.finished_s or o.arrival_s for o in burst if not o.rejected)
    assert idle_at < LIGHT_FROM_S, idle_at
    replicas = result.describe["replicas"]
    assert isinstance(replicas, dict)
    return Run(
        result.outcomes, idle_at, dict(policy.retry_after_s), next(iter(replicas.values()))["prefill_share"]
    )


def _light(run: Run) -> list[Outcome]:
    return [o for o in run.outcomes if o.arrival_s >= LIGHT_FROM_S]


def test_an_idle_replica_admits_within_seconds_of_a_burst() -> None:
    run = replay()
    late = [o for o in _light(run) if o.arrival_s >= run.idle_at + BACK_WITHIN_S]
    assert len(late) >= 60
    refused = [(round(o.arrival_s, 1), o.reason, run.retry_after_s.get(o.index)) for o in late if o.rejected]
    assert not refused, f"idle at {run.idle_at:.1f} s, share {run.prefill_share}: refused {refused[:8]}"
    # And they meet the targets: the replica is as idle as the forecast should say.
    missed = [
        o.index for o in late if o.finished_s is not None and not o.met(Targets(TTFT_TARGET_S, TPOT_TARGET_S))
    ]
    assert not missed


def test_one_token_requests_are_never_refused_after_the_burst() -> None:
    run = replay()
    hi = [o for o in _light(run) if o.prompt_tokens == 1]
    assert len(hi) >= 40
    assert not [o.arrival_s for o in hi if o.rejected]


def test_no_long_retry_after_while_the_same_size_is_admitted_a_second_later() -> None:
    """The lock-out answered Retry-After 43-60 s while the replica took the same requests 0.3 s later.
    Here every refusal's Retry-After (jittered) is compared with the next admission of a request
    of the same size: one within a second may follow only a short Retry-After."""
    run = replay()
    admitted: dict[int, list[float]] = {}
    for o in run.outcomes:
        if not o.rejected:
            admitted.setdefault(o.prompt_tokens, []).append(o.arrival_s)
    told = [(o, run.retry_after_s.get(o.index)) for o in run.outcomes if o.rejected]
    contradicted = [
        (round(o.arrival_s, 2), round(after, 1))
        for o, after in told
        if after is not None
        and after > LONGEST_CONTRADICTED_S
        and any(o.arrival_s < t <= o.arrival_s + 1.0 for t in admitted.get(o.prompt_tokens, ()))
    ]
    assert len(told) >= 500
    assert not contradicted
