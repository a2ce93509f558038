"""Replicas a workload needs: replay it in virtual time at N replicas, score every class, search N.

Each replay is ``replay.run_gateway_replay``: the shipped ``AdmissionEngine`` (under the
``admission`` settings given, whatever their ``policy``) and ``PredictionService`` in front of N
emulated vLLM engines of one profile, the same loop the goodput benchmark runs. A request's class
is drawn from the class mix by its index (deterministic). A class's attainment is the share of its
OFFERED requests that finished with TTFT (from arrival, queueing included) and mean TPOT within its
targets: a refusal is a miss, so refusing cannot make a fleet look big enough.

``smallest_meeting`` searches the smallest N whose replay meets every class's attainment target,
starting from an estimate and returning the replays it ran, so that N and N - 1 are both on record.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.admission import AdmissionSettings
from gateway.prediction import ReplicaFacts
from planner.workload import Workload
from replay.admission import run_gateway_replay
from replay.policies import SluicePolicy
from replay.requests import FleetConfig, GatewayRequest, Outcome, Targets
from simulator.profile import Profile

__all__ = [
    "ClassResult",
    "ClassTarget",
    "ReplayScore",
    "SearchResult",
    "facts_of",
    "replay_at",
    "smallest_meeting",
]


@dataclass(frozen=True, slots=True)
class ClassTarget:
    """One class's targets: TTFT and mean TPOT (seconds), the share of its requests that must meet
    both (``attainment``, 0-1), and its share of the traffic (``share``, 0-1]."""

    name: str
    ttft_s: float
    tpot_s: float
    attainment: float
    share: float = 1.0

    @property
    def targets(self) -> Targets:
        return Targets(self.ttft_s, self.tpot_s)


@dataclass(frozen=True, slots=True)
class ClassResult:
    """One class in one replay: requests offered, met (both targets), refused, and latencies of
    the requests that finished (seconds; ``nan`` when none did). ``busy_s``: engine seconds the
    replay attributed to the class's requests (each step's time split by the tokens each request
    had in it; all replicas); ``tokens`` / ``output_tokens``: prompt + output and output tokens of
    its finished requests."""

    name: str
    offered: int
    met: int
    refused: int
    target: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    busy_s: float = 0.0
    tokens: int = 0
    output_tokens: int = 0

    @property
    def attainment(self) -> float:
        """Share of offered requests that met both targets (1.0 when none was offered)."""
        return self.met / self.offered if self.offered else 1.0

    @property
    def meets(self) -> bool:
        return self.attainment >= self.target


@dataclass(frozen=True, slots=True)
class ReplayScore:
    """A replay at ``replicas``: per class results, goodput (requests and output tokens per second
    that met their class's targets, over the scored span), the engines' busy share (0-1: time
    with a step running over replicas x the replay's length; continuous batching keeps it near 1
    under any steady load, so it is no utilisation), and the preemptions the engines made.
    ``run_s``: seconds from the first scored arrival to the replay's end, the span the classes'
    engine time accrued over (the scored span plus the drain after the last arrival; the scored
    span when not given)."""

    replicas: int
    classes: tuple[ClassResult, ...]
    scored_s: float
    goodput_rps: float
    goodput_output_tps: float
    goodput_tps: float
    busy_share: float
    preemptions: int
    run_s: float = 0.0

    @property
    def meets(self) -> bool:
        """Every class at or above its attainment target."""
        return all(c.meets for c in self.classes)


class _MixedClassPolicy(SluicePolicy):
    """Sluice's policy with each request judged as the class ``class_of(index)`` says."""

    def __init__(self, settings: AdmissionSettings, class_of: Callable[[int], str], *, seed: int) -> None:
        super().__init__(settings, seed=seed, name="plan")
        self._class_of = class_of

    def _submit(self, request: GatewayRequest, now: float) -> None:
        self.request_class = self._class_of(request.index)
        super()._submit(request, now)


def class_picker(classes: Sequence[ClassTarget], seed: int = 0) -> Callable[[int], str]:
    """Request index -> class name, drawn by the classes' shares (normalised), deterministic."""
    total = sum(c.share for c in classes)
    if not classes or total <= 0:
        raise ValueError("at least one class with a share > 0 is needed")
    edges: list[tuple[float, str]] = []
    acc = 0.0
    for c in classes:
        acc += c.share / total
        edges.append((acc, c.name))
    if len(classes) == 1:
        only = classes[0].name
        return lambda _: only

    def pick(index: int) -> str:
        u = random.Random(f"class:{seed}:{index}").random()
        return next((name for edge, name in edges if u < edge), edges[-1][1])

    return pick


def facts_of(profile: Profile) -> ReplicaFacts:
    """What an operator would write for a replica of ``profile`` (the predictor never reads the
    profile itself: it learns the rest from the engines' ``/metrics``)."""
    e = profile.engine
    return ReplicaFacts(
        gpu=profile.gpu.name,
        model=profile.served_model_name,
        tensor_parallel=profile.tensor_parallel,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len,
    )


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def score_outcomes(
    outcomes: Sequence[Outcome],
    classes: Sequence[ClassTarget],
    class_of: Callable[[int], str],
    replicas: int,
    scored_s: float,
    busy_share: float,
    run_s: float = 0.0,
) -> ReplayScore:
    """Score ``outcomes`` (the scored ones) per class; see ``ReplayScore``."""
    by_name = {c.name: c for c in classes}
    results: list[ClassResult] = []
    good = good_out = good_all = 0
    for c in classes:
        mine = [o for o in outcomes if class_of(o.index) == c.name]
        met = [o for o in mine if o.met(c.targets)]
        done = [o for o in mine if o.finished_s is not None and o.ttft_s is not None]
        finished = [o for o in mine if o.finished_s is not None and not o.rejected]
        ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
        tpots = [o.tpot_s for o in done if o.tpot_s is not None]
        results.append(
            ClassResult(
                c.name,
                len(mine),
                len(met),
                sum(o.rejected for o in mine),
                by_name[c.name].attainment,
                _quantile(ttfts, 0.5),
                _quantile(ttfts, 0.99),
                _quantile(tpots, 0.5),
                _quantile(tpots, 0.99),
                sum(o.busy_s for o in mine),
                sum(o.prompt_tokens + o.output_tokens for o in finished),
                sum(o.output_tokens for o in finished),
            )
        )
        good += len(met)
        good_out += sum(o.output_tokens for o in met)
        good_all += sum(o.output_tokens + o.prompt_tokens for o in met)
    span = max(scored_s, 1e-9)
    return ReplayScore(
        replicas,
        tuple(results),
        scored_s,
        good / span,
        good_out / span,
        good_all / span,
        busy_share,
        sum(o.preemptions for o in outcomes),
        max(run_s, scored_s),
    )


def replay_at(
    workload: Workload,
    profile: Profile,
    settings: AdmissionSettings,
    classes: Sequence[ClassTarget],
    replicas: int,
    *,
    seed: int = 0,
    warmup_s: float = 0.0,
    max_tokens: int = 1000,
    to_the_end: bool = False,
) -> ReplayScore:
    """Replay ``workload`` through the admission engine in front of ``replicas`` engines of
    ``profile``; requests arriving before ``warmup_s`` load the fleet but are not scored.
    ``max_tokens``: the clients' output cap (the gateway sizes requests with it). The replay stops
    following a request once it is a certain miss (no first token by the loosest TTFT target), so
    its latencies are missing from the quantiles; ``to_the_end``: follow every request to its
    last token instead (slower under overload; for latency curves)."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    class_of = class_picker(classes, seed)
    config = FleetConfig(profile, facts_of(profile), replicas=replicas, seed=seed, max_tokens=max_tokens)
    policy = _MixedClassPolicy(settings, class_of, seed=seed)
    # The replay stops following a request once it is a certain miss: use the loosest targets.
    loosest = Targets(
        math.inf if to_the_end else max(c.ttft_s for c in classes), max(c.tpot_s for c in classes)
    )
    span = (warmup_s, math.inf)
    result = run_gateway_replay(workload.requests, config, policy, targets=loosest, scored=span)
    scored = [o for o in result.outcomes if o.arrival_s >= warmup_s]
    busy = result.busy_s / (replicas * result.end_s) if result.end_s > 0 else 0.0
    scored_s = workload.duration_s - warmup_s
    return score_outcomes(scored, classes, class_of, replicas, scored_s, busy, result.end_s - warmup_s)


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The smallest replica count found to meet the targets (``None``: not within the limit), and
    every replay the search ran, by replica count."""

    replicas: int | None
    replays: Mapping[int, ReplayScore] = field(default_factory=dict)
    limit: int = 0

    @property
    def at(self) -> ReplayScore | None:
        """The replay at the recommended count."""
        return None if self.replicas is None else self.replays[self.replicas]

    @property
    def below(self) -> ReplayScore | None:
        """The replay at one fewer (``None`` at 1 replica: zero replicas serve nothing)."""
        return None if self.replicas is None else self.replays.get(self.replicas - 1)


def smallest_meeting(evaluate: Callable[[int], ReplayScore], start: int, limit: int) -> SearchResult:
    """The smallest N in ``1..limit`` whose ``evaluate(N).meets``, assuming more replicas never
    hurt: from ``start``, walk down (doubling the step) while it meets, or up while it fails, then
    bisect the bracket. N - 1 is always evaluated (so its failure is on record), unless N is 1."""
    if limit < 1:
        raise ValueError("limit must be >= 1")
    replays: dict[int, ReplayScore] = {}

    def ok(n: int) -> bool:
        if n <= 0:
            return False
        if n not in replays:
            replays[n] = evaluate(n)
        return replays[n].meets

    n = min(max(1, start), limit)
    step = 1
    if ok(n):
        lo, hi = 0, n
        while hi - step > 0:
            if not ok(hi - step):
                lo = hi - step
                break
            hi -= step
            step *= 2
    else:
        lo, hi = n, 0
        while True:
            cand = min(lo + step, limit)
            if cand == lo:
                return SearchResult(None, replays, limit)
            if ok(cand):
                hi = cand
                break
            lo, step = cand, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return SearchResult(hi, replays, limit)
