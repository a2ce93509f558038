"""No lock-out, per decision: one-token requests, a refusal's story, its Retry-After.

The state here is the one a burst left behind before the prediction service forgot it on an idle
scrape (``test_lockout.py`` replays the whole of it): a replica with nothing running or waiting
whose load still says 90 % of every step goes to others' prefill, so a newcomer's forecast TPOT
is ten idle decode steps.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import replace

from gateway.admission import (
    AdmissionSettings,
    Admit,
    Blocker,
    Queue,
    Reject,
    ReplicaView,
    RetryAfterPolicy,
    SloAdmitter,
)
from gateway.admission.headers import PREDICTED_TPOT_MS, PREDICTED_TTFT_MS, decision_headers
from predictor.correction import Correction
from tests.unit.admission.fleet import MODEL, request, state, streams, view

NOW = 1000.0
#: A class that sets only its two targets (no stall budget; it queues up to 1 s, the default).
PLAIN = AdmissionSettings.model_validate(
    {"classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.05}}, "default_class": "plain"}
)
#: The same class, never queued: refused at once when no replica takes it.
UNQUEUED = AdmissionSettings.model_validate(
    {
        "classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.05, "max_queue_wait_s": 0.0}},
        "default_class": "plain",
    }
)
#: Idle, with a burst's prefill share still in its load.
AFTER_BURST = replace(state(), prefill_share=0.9)


def decide(
    views: list[ReplicaView], config: AdmissionSettings, *, max_tokens: int = 64, prompt: int = 20
) -> Admit | Queue | Reject:
    admitter = SloAdmitter(config, RetryAfterPolicy(config.retry_after, random.Random(3)))
    return admitter.decide(
        request(prompt, 16.0, request_class="plain", arrival=NOW, max_tokens=max_tokens), views, NOW
    )


def _ms(message: str, label: str) -> str:
    """The number of milliseconds after ``label`` in ``message``."""
    found = re.search(re.escape(label) + r" ([0-9.]+) ms", message)
    assert found is not None, message
    return found.group(1)


def test_one_output_token_is_never_refused_on_tpot() -> None:
    # Two output tokens: refused on their TPOT (ten idle steps a token, against a 50 ms target).
    two = decide([view("a", AFTER_BURST)], PLAIN, max_tokens=2)
    assert isinstance(two, Queue | Reject)
    assert two.blocker == Blocker.TPOT
    # One: it has no time per output token.
    assert isinstance(decide([view("a", AFTER_BURST)], PLAIN, max_tokens=1), Admit)
    assert isinstance(decide([view("a", AFTER_BURST)], UNQUEUED, max_tokens=1), Admit)
    # Even where no replica could ever meet the TPOT target (an idle step is ~7 ms).
    hopeless = AdmissionSettings.model_validate(
        {"classes": {"plain": {"tpot_target_s": 0.001}}, "default_class": "plain"}
    )
    assert isinstance(decide([view("a", state())], hopeless, max_tokens=1), Admit)
    refused = decide([view("a", state())], hopeless, max_tokens=2)
    assert isinstance(refused, Reject)
    assert refused.retry_after is None
    # Its class queues, yet no wait helps: the body still names the TPOT that fails.
    tpot = decision_headers(refused, "plain", hopeless)[PREDICTED_TPOT_MS]
    assert _ms(refused.message, "time per output token") == tpot
    assert "idle replica" in refused.message
    # The TPOT failed, not the TTFT: the body names that target and the setting to change, and
    # no replica (its name is the operator's: the log line carries it).
    assert "1 ms TPOT target" in refused.message
    assert "TTFT" not in refused.message
    assert "admission.classes.plain.tpot_target_s" in refused.message
    assert refused.replica == "a"
    assert "replica a" not in refused.message


def test_a_refusal_on_tpot_names_its_tpot_in_the_body_and_the_headers() -> None:
    refused = decide([view("a", AFTER_BURST)], UNQUEUED)
    assert isinstance(refused, Reject)
    assert refused.blocker == Blocker.TPOT
    headers = decision_headers(refused, "plain", UNQUEUED)
    # The body cites the TPOT the header carries, with its target; not a first token "late".
    assert _ms(refused.message, "time per output token") == headers[PREDICTED_TPOT_MS]
    assert "50 ms TPOT target" in refused.message
    assert "first token" not in refused.message
    assert "replica a" not in refused.message


def test_a_late_first_token_names_the_wait_and_the_ttft_the_header_carries() -> None:
    """A class that queues: the wait for its TPOT to come under target would make its first token
    late, so it is refused at once; the body says so with the TTFT and TPOT of the headers
    (before: "first token predicted 65.1 s after the 2 s TTFT target" beside a header TTFT of
    78.6 ms, the wait unsaid)."""
    busy = replace(state(64, mean_remaining=400.0), prefill_share=0.9)
    # The replica's dispatch overhead is in the TTFT admission judges: the header's too.
    replica = ReplicaView.build(
        "a", healthy=True, model=MODEL, state=busy, streams=streams(64, "plain"), dispatch_overhead_s=0.25
    )
    refused = decide([replica], PLAIN)
    assert isinstance(refused, Reject)
    assert refused.blocker == Blocker.TPOT
    assert refused.message.startswith("first token predicted")
    headers = decision_headers(refused, "plain", PLAIN)
    assert _ms(refused.message, "predicted TTFT") == headers[PREDICTED_TTFT_MS]
    assert _ms(refused.message, "time per output token") == headers[PREDICTED_TPOT_MS]
    assert refused.forecast is not None
    assert refused.forecast.overhead_s >= 0.25  # the whole hop, or the steps it misses


def test_retry_after_is_bounded_by_the_replica_draining_to_idle() -> None:
    # Idle: it fits once the load's share is measured again; never told to wait a typical
    # request's length (256 tokens at the stretched TPOT: ~20 s here, 41-59 s in the lock-out).
    idle = decide([view("a", AFTER_BURST)], UNQUEUED)
    assert isinstance(idle, Reject)
    assert idle.retry_after is not None
    assert idle.retry_after.base_s <= 0.01
    assert idle.retry_after.seconds == 1
    # Busy: no longer than the predicted time for everything on it to finish.
    four = replace(state(4, mean_remaining=20.0), prefill_share=0.9)
    busy = decide([view("a", four)], UNQUEUED)
    assert isinstance(busy, Reject)
    assert busy.retry_after is not None
    # Four decodes of 20 tokens left each: the last finishes after ~20 x H_4 steps at the
    # forecast's TPOT (the share's stretch in it).
    assert busy.forecast is not None
    bound = 20.0 * (math.log(4.5) + 0.5773) * busy.forecast.tpot_s
    assert 0.0 < busy.retry_after.base_s <= bound


def test_requests_the_state_does_not_size_drain_as_long_as_the_refused_ones_output() -> None:
    """Four decodes the gateway does not know one by one (its streams ended, the scrape not yet
    caught up), their remaining output unsaid: the drain bound takes the refused request's own
    expected output (16 tokens, the traffic the gateway sees), not a 256-token default (which a
    TPOT stretched 5x by a burst's correction made 20-30 s while the replica emptied in a
    second)."""
    four = replace(state(4), prefill_share=0.9)
    assert four.mean_remaining_output_tokens == 0.0
    refused = decide([view("a", four)], UNQUEUED)
    assert isinstance(refused, Reject)
    assert refused.retry_after is not None
    assert refused.forecast is not None
    bound = 16.0 * (math.log(4.5) + 0.5773) * refused.forecast.tpot_s
    assert 0.0 < refused.retry_after.base_s <= bound * 1.001


def test_an_idle_replica_that_keeps_refusing_is_probed_every_few_seconds() -> None:
    """A fit a burst taught can make even an idle replica's forecast miss the targets, and only
    the replica's own steps can correct it: an idle replica refusing requests on their own
    targets takes one anyway every ``PROBE_AFTER_S``; a busy one never."""
    slow = AdmissionSettings.model_validate(
        {"classes": {"plain": {"tpot_target_s": 0.005}}, "default_class": "plain"}  # idle step ~7 ms
    )
    admitter = SloAdmitter(slow, RetryAfterPolicy(slow.retry_after, random.Random(3)))

    def at(t: float, replica: ReplicaView) -> Admit | Queue | Reject:
        asked = request(20, 16.0, request_class="plain", arrival=t, max_tokens=16)
        return admitter.decide(asked, [replica], t)

    idle = view("a", state())
    got = [type(at(NOW + t, idle)).__name__ for t in (0.0, 1.0, 2.0, 2.5, 3.9, 4.0, 4.1)]
    assert got == ["Reject", "Reject", "Admit", "Reject", "Reject", "Admit", "Reject"]
    probe = at(NOW + 6.0, idle)
    assert isinstance(probe, Admit)
    assert probe.forecast is not None
    assert probe.slack < 0.0  # the forecast still says it misses
    # A replica with anything running is never probed: its forecast has load to go by.
    busy = view("b", state(1))
    assert all(isinstance(at(NOW + t, busy), Reject) for t in (0.0, 3.0, 6.0, 9.0))


def test_a_correction_learned_under_load_never_makes_an_idle_replica_hopeless() -> None:
    """A burst taught the replica's correction that TPOTs run 5x its model; idle again, the
    corrected forecast misses a 20 ms target that the model's own idle forecast (~7 ms) meets. The
    refusal carries a Retry-After: "not attainable even on an idle replica" would tell clients to
    stop retrying, and only admitted requests could unlearn the factor."""
    learned = Correction(ttft=(1.0,) * 16, tpot=(5.0,) * 16)
    tight = AdmissionSettings.model_validate(
        {
            "classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.02, "max_queue_wait_s": 0.0}},
            "default_class": "plain",
        }
    )
    replica = ReplicaView.build("a", healthy=True, model=MODEL, state=state(), correction=learned)
    refused = decide([replica], tight)
    assert isinstance(refused, Reject)
    assert refused.blocker == Blocker.TPOT
    assert refused.retry_after is not None
    assert "idle replica" not in refused.message
    # A correction below 1 still applies: a model that overstates TPOT 4x admits at a 4 ms
    # target its own idle forecast (~7 ms) misses.
    fast = Correction(ttft=(1.0,) * 16, tpot=(0.25,) * 16)
    tighter = AdmissionSettings.model_validate(
        {
            "classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.004, "max_queue_wait_s": 0.0}},
            "default_class": "plain",
        }
    )
    replica = ReplicaView.build("a", healthy=True, model=MODEL, state=state(), correction=fast)
    assert isinstance(decide([replica], tighter), Admit)
