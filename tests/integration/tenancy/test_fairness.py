"""Fair share when the fleet is saturated, end to end (issue 5, point 5).

A real ``sluice serve`` (tenancy with API keys, SLO admission, the gateway queue) in front of a
real emulated replica, two tenants, and closed-loop clients that keep the replica full and both
tenants' requests waiting in the gateway's queue for the whole run (``fair_share`` explains the
set-up). ``docs`` sends long documents (2000-token prompts, 16-token answers), ``chat`` short
chats (100-token prompts, 100-token answers): a document costs about five chats in the weighted
tokens Sluice charges (``docs/tenants.md`` compares them with the replica's time).

Each tenant's GPU time over the measured window (``Scenario.window``, until the clients stop) is
the weighted tokens (``w_in x prompt + w_out x output``, the costs the fair share charges) of its
requests that finished in the window. What must hold:

* with ``fairness: tokens`` (the default), each tenant's share is within 10 % (relative:
  ``|share - target| / target <= 0.10``) of its weighted share ``weight / sum of weights``, for
  weights 1 : 1 and 2 : 1, and when the documents arrive after the chats have had the replica
  to themselves for a while (no banked credit either way: the newcomer starts level);
* with ``fairness: requests`` and the same workload, both tenants get about as many requests
  served, and the document tenant therefore most of the GPU time.

Every scenario starts its own gateway (fresh counters) in front of one replica shared by the
module. ``-s`` prints each scenario's numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.tenancy.fair_share import (
    SHAPES,
    SLOTS,
    LoadRun,
    Running,
    cost_weights,
    drive,
    emulator,
    gateway,
    gateway_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: Seconds of load before the window opens (the first requests are admitted in arrival order,
#: before any queue forms; the counters then need a few seconds to even out).
WARMUP_S = 3.0
#: Seconds of load in all.
LOAD_S = 14.0
#: Largest relative distance of a share from its target (the issue's "within 10 %").
TOLERANCE = 0.10


@dataclass(frozen=True)
class Scenario:
    fairness: str
    docs_weight: float
    chat_weight: float = 1.0
    #: When the documents' clients start, seconds into the run (the chats' start at once).
    docs_join_s: float = 0.0

    @property
    def window(self) -> tuple[float, float]:
        """The measured window, seconds into the run: from ``WARMUP_S`` (or the documents' join,
        if later: the queue is formed by then) until the load stops."""
        return max(WARMUP_S, self.docs_join_s), LOAD_S

    @property
    def weights(self) -> dict[str, float]:
        return {"docs": self.docs_weight, "chat": self.chat_weight}

    def target(self, tenant: str) -> float:
        """``tenant``'s weighted share of the GPU."""
        return self.weights[tenant] / sum(self.weights.values())


TOKENS_1_1 = Scenario("tokens", 1.0)
TOKENS_2_1 = Scenario("tokens", 2.0)
REQUESTS_1_1 = Scenario("requests", 1.0)
#: The chats have the replica to themselves for 4 s (their counter runs ahead), then the
#: documents arrive: lifted to the chats' counter, they get half from then on, not all of it
#: until they have caught up (about 1 s of the whole replica).
DOCS_JOIN_LATE = Scenario("tokens", 1.0, docs_join_s=4.0)
SCENARIOS = (TOKENS_1_1, TOKENS_2_1, REQUESTS_1_1, DOCS_JOIN_LATE)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with emulator(tmp_path_factory.mktemp("fair-replica")) as running:
        yield running


@pytest.fixture(scope="module")
def runs(replica: Running, tmp_path_factory: pytest.TempPathFactory) -> dict[Scenario, LoadRun]:
    """Every scenario's run, once per module (the tests below only read them)."""
    out: dict[Scenario, LoadRun] = {}
    for scenario in SCENARIOS:
        directory: Path = tmp_path_factory.mktemp(f"fair-{scenario.fairness}-{scenario.docs_weight:g}")
        config = gateway_config(replica.url, scenario.weights, scenario.fairness)
        with gateway(directory, config) as gw:
            try:
                joins = {"docs": scenario.docs_join_s}
                out[scenario] = asyncio.run(drive(gw.url, replica.url, LOAD_S, joins_s=joins))
            finally:
                log = gw.proc.output()
        _print(scenario, out[scenario])
        if "Traceback" in log:
            print(f"--- gateway log ({scenario}) ---\n{log[-3000:]}")
    return out


def _print(scenario: Scenario, run: LoadRun) -> None:
    weights = cost_weights()
    start, end = scenario.window
    shares = run.shares(start, end, weights)
    gpu = run.gpu(start, end, weights)
    counts = run.counts(start, end)
    window = [s for s in run.samples if start <= s.at < end]
    joins = f" docs join at {scenario.docs_join_s:g} s" if scenario.docs_join_s else ""
    print(
        f"\nfairness={scenario.fairness} weights docs:chat={scenario.docs_weight:g}:{scenario.chat_weight:g}"
        f"{joins}"
        f" | window [{start:g}, {end:g}) s | gateway queue min {min(s.queued for s in window):.0f}"
        f" | replica running mean {sum(s.running for s in window) / len(window):.1f}"
    )
    for tenant in SHAPES:
        print(
            f"  {tenant:5s} requests {counts[tenant]:4d} weighted tokens {gpu[tenant]:7.3f} "
            f"share {shares[tenant]:.3f} (weighted share {scenario.target(tenant):.3f})"
        )


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s.fairness}-{s.docs_weight:g}-1")
def test_the_fleet_was_saturated_and_every_request_served(
    runs: dict[Scenario, LoadRun], scenario: Scenario
) -> None:
    run = runs[scenario]
    assert not run.errors, run.errors[:5]
    assert {a.status for a in run.answers} == {200}
    assert all(a.completion_tokens == SHAPES[a.tenant].output_tokens for a in run.answers)
    assert all(a.prompt_tokens == SHAPES[a.tenant].prompt_tokens for a in run.answers)
    # Both tenants waited in the gateway's queue all along: tenant X's waiting requests are at
    # least (its outstanding requests) - (requests on the replica) >= queue length - the other
    # tenant's clients, so a queue longer than either tenant's client count proves it (a client
    # between an answer and its next request is the slack: at most a few per sample).
    start, end = scenario.window
    window = [s for s in run.samples if start <= s.at < end]
    assert len(window) >= 10
    most_clients = max(shape.clients for shape in SHAPES.values())
    backlogged = [s for s in window if s.queued > most_clients]
    assert len(backlogged) >= 0.9 * len(window), [(s.at, s.queued) for s in window]
    # ... and the replica was kept full.
    assert sum(s.running for s in window) / len(window) >= 0.6 * SLOTS


@pytest.mark.parametrize(
    "scenario",
    [TOKENS_1_1, TOKENS_2_1, DOCS_JOIN_LATE],
    ids=["weights-1-1", "weights-2-1", "docs-join-late"],
)
def test_each_tenant_gets_its_weighted_share_of_gpu_time(
    runs: dict[Scenario, LoadRun], scenario: Scenario
) -> None:
    shares = runs[scenario].shares(*scenario.window, cost_weights())
    for tenant, share in shares.items():
        target = scenario.target(tenant)
        assert abs(share - target) / target <= TOLERANCE, (tenant, shares, scenario)


def test_request_count_fairness_gives_the_documents_most_of_the_gpu(runs: dict[Scenario, LoadRun]) -> None:
    by_requests = runs[REQUESTS_1_1]
    counts = by_requests.counts(*REQUESTS_1_1.window)
    # What request-count fairness equalises: requests served.
    assert counts["docs"] == pytest.approx(counts["chat"], rel=TOLERANCE), counts
    # What it gives: a document costs about five chats, so the documents get most of the GPU ...
    docs = by_requests.shares(*REQUESTS_1_1.window, cost_weights())["docs"]
    assert docs > 0.75, docs
    # ... where token fairness gave them half; and token fairness served many more chats.
    by_tokens = runs[TOKENS_1_1]
    assert docs > by_tokens.shares(*TOKENS_1_1.window, cost_weights())["docs"] + 0.2
    tokens_counts = by_tokens.counts(*TOKENS_1_1.window)
    assert tokens_counts["chat"] > 3 * tokens_counts["docs"], tokens_counts
