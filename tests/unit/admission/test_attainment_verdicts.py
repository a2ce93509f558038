"""When the engine judges a request for its class's attainment: at its first-token deadline
when it has no first token by then (a miss, whatever comes next), else at its end (its TPOT
known too). The engine is the shipped ``AdmissionEngine`` on the test's clock, policy ``none``
(everything admitted), one replica; the ``interactive`` class's TTFT target is ``TTFT``."""

from __future__ import annotations

from gateway.admission.engine import AdmissionEngine
from gateway.admission.results import Ending, Submitted
from gateway.replicas.registry import LiveRequest
from tests.unit.admission.test_policies import Predictions, engine_with, policy_settings

CONFIG = policy_settings("none")
TTFT = CONFIG.classes["interactive"].ttft_target_s
TPOT = CONFIG.classes["interactive"].tpot_target_s


def send(engine: AdmissionEngine, rid: str, now: float) -> tuple[Submitted, LiveRequest]:
    """Request ``rid`` admitted at ``now``, and its in-flight entry (where the relay marks tokens)."""
    req = engine.request(
        rid, "m", prompt_tokens=100, max_tokens=50, request_class="interactive", arrival_s=now
    )
    sent = engine.submit(req, "m", now)
    assert isinstance(sent, Submitted)
    assert isinstance(sent.entry, LiveRequest)
    return sent, sent.entry


def window(engine: AdmissionEngine, now: float) -> tuple[int, float | None]:
    (state,) = engine.attainment.states(now)
    return state.samples, state.attainment


def test_a_request_without_a_first_token_at_its_deadline_is_a_miss_then() -> None:
    engine = engine_with(CONFIG, Predictions())
    send(engine, "late", 0.0)
    engine.reevaluate(TTFT - 0.01)
    assert list(engine.attainment.states(TTFT)) == []  # not judged before its deadline
    engine.reevaluate(TTFT + 0.01)
    assert window(engine, TTFT + 0.01) == (1, 0.0)  # judged at its deadline, long before its end


def test_a_first_token_in_time_is_judged_at_the_end_with_its_tpot() -> None:
    engine = engine_with(CONFIG, Predictions())
    sent, entry = send(engine, "slow-stream", 0.0)
    entry.first_token_at = 0.5 * TTFT
    engine.reevaluate(TTFT + 0.01)
    assert list(engine.attainment.states(TTFT + 0.01)) == []  # met so far: not judged yet
    # Then its stream misses the TPOT target: 50 tokens at twice the target.
    end = 0.5 * TTFT + 49 * 2.0 * TPOT
    entry.last_token_at = end
    engine.finish(sent.key, Ending(produced_tokens=50, finished_at=end), end)
    assert window(engine, end) == (1, 0.0)


def test_a_late_first_token_is_a_miss_at_the_deadline_and_judged_once() -> None:
    engine = engine_with(CONFIG, Predictions())
    sent, entry = send(engine, "late-token", 0.0)
    entry.first_token_at = TTFT + 0.1
    engine.reevaluate(TTFT + 0.2)
    assert window(engine, TTFT + 0.2) == (1, 0.0)
    entry.last_token_at = TTFT + 1.0
    engine.finish(sent.key, Ending(produced_tokens=10, finished_at=TTFT + 1.0), TTFT + 1.0)
    assert window(engine, TTFT + 1.0) == (1, 0.0)  # not counted twice


def test_a_request_that_ends_before_its_deadline_is_judged_once_at_its_end() -> None:
    engine = engine_with(CONFIG, Predictions())
    sent, entry = send(engine, "short", 0.0)
    entry.first_token_at = 0.1
    entry.last_token_at = 0.2
    engine.finish(sent.key, Ending(produced_tokens=2, finished_at=0.2), 0.2)
    assert window(engine, 0.2) == (1, 1.0)
    engine.reevaluate(TTFT + 1.0)
    assert window(engine, TTFT + 1.0) == (1, 1.0)  # its deadline passing judges nothing more


def test_a_verdict_is_withdrawn_when_the_replica_refused_the_request() -> None:
    engine = engine_with(CONFIG, Predictions())
    sent, _ = send(engine, "refused-late", 0.0)
    engine.reevaluate(TTFT + 0.01)
    assert window(engine, TTFT + 0.01) == (1, 0.0)
    engine.replica_refused(sent.key, 1.0, "overloaded", TTFT + 0.02)
    engine.finish(sent.key, Ending(learn=False), TTFT + 0.02)
    assert window(engine, TTFT + 0.02) == (0, None)


def test_misses_known_early_tighten_before_the_streams_end() -> None:
    """Twenty requests without a first token at their deadline: the margin tightens then,
    though none of them has ended."""
    engine = engine_with(CONFIG, Predictions())
    base = engine.attainment.margin("interactive", "r0", 0.0)
    for i in range(20):
        send(engine, f"q{i}", 0.01 * i)
    engine.reevaluate(TTFT + 0.5)
    assert engine.attainment.margin("interactive", "r0", TTFT + 0.5) > base
