"""Invariants over many seeded random fleets: what is admitted meets its targets and spares the
running streams; what is refused says truthfully why; nothing raises."""

from __future__ import annotations

import random

import pytest

from gateway.admission import Admit, Queue, Reject, RejectReason, ReplicaView
from tests.unit.admission.fleet import SETTINGS, UNKNOWN, controller, request, state, streams, view

NOW = 1000.0


def random_fleet(rng: random.Random) -> list[ReplicaView]:
    fleet = []
    for i in range(rng.randint(1, 8)):
        decodes = rng.choice([0, 4, 32, 128, 256])
        replica = state(
            decodes,
            context=rng.choice([500, 2000, 6000]),
            queued=[rng.choice([500, 4000, 8192]) for _ in range(rng.randint(0, 10))],
            kv_capacity=2_000_000,
            max_num_seqs=rng.choice([64, 256, 1024]),
            max_len=rng.choice([8192, 131_072]),
            stale=rng.random() < 0.2,
        )
        running = streams(
            min(decodes, rng.randint(0, 48)),
            rng.choice(["interactive", "batch"]),
            tpot_s=rng.uniform(0.005, 0.11),
            generated=rng.randint(0, 100),
            expected=float(rng.randint(100, 600)),
        )
        fleet.append(
            view(
                f"r{i}",
                replica,
                running,
                healthy=rng.random() < 0.9,
                model=UNKNOWN if rng.random() < 0.05 else view("x", state()).model,
            )
        )
    return fleet


@pytest.mark.parametrize("seed", range(40))
def test_admitted_requests_meet_their_targets_and_spare_running_streams(seed: int) -> None:
    rng = random.Random(seed)
    ctl = controller(seed=seed)
    for _ in range(25):
        views = random_fleet(rng)
        cls_name = rng.choice(["interactive", "batch"])
        cls = SETTINGS.classes[cls_name]
        arrival = NOW - rng.choice([0.0, 0.0, 0.5])
        r = request(
            rng.choice([50, 500, 4000, 20_000, 100_000]),
            float(rng.randint(10, 800)),
            request_class=cls_name,
            arrival=arrival,
            max_tokens=rng.choice([None, 256, 1024]),
            deadline=arrival + rng.choice([0.2, 5.0]) if rng.random() < 0.3 else None,
        )
        decision = ctl.submit(r, views, NOW)
        assert decision.enforced
        if isinstance(decision, Admit):
            target = next(v for v in views if v.name == decision.replica)
            assert target.healthy
            f = decision.forecast
            if f is None:  # an uncalibrated replica below its cap
                continue
            assert NOW + f.ttft_s <= r.first_token_deadline_s(cls) + 1e-9
            assert f.tpot_s <= cls.tpot_target_s + 1e-12
            for name, load in target.loads.items():
                limit = SETTINGS.class_settings(name).tpot_target_s
                assert load.max_tpot_s + f.inflicted_tpot_s <= limit + 1e-12
        elif isinstance(decision, Queue):
            assert decision.entry_id is not None
            assert decision.earliest_retry_s >= 0
        else:
            assert isinstance(decision, Reject)
            assert decision.message
            if decision.reason == RejectReason.PROMPT_TOO_LARGE:
                assert decision.retry_after is None
            if decision.retry_after is not None:
                assert 0.1 <= decision.retry_after.delay_s <= 60.0
                assert decision.retry_after.seconds >= 1
    # Whatever was queued leaves with an answer by its deadline.
    later = NOW + 120.0
    result = ctl.reevaluate(later, [view("idle", state())])
    assert len(ctl.queue) == 0
    assert all(r.reason == RejectReason.DEADLINE_EXCEEDED for _, r in result.rejected)
