"""Score forecasts: real trace arrivals against emulated vLLM engines, predictions vs outcomes.

Each arrival goes to the replica with the fewest outstanding requests (ties round robin, as
``gateway.replicas.registry`` picks); ``PredictionService.forecast`` is asked about it first, on
the gateway's in-flight view of that replica, then it is dispatched. Finished requests are
recorded with their actual TTFT and TPOT, and ``PredictionService.on_finished`` learns their
usage. The service is fed each engine's ``/metrics`` text through the same parsing, windowing
and calibration code the live gateway runs, and never sees the emulator's profile: only
``ReplicaFacts``. It all runs on the one virtual-time loop, ``replay.loop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.prediction import PredictionConfig, PredictionService, ReplicaFacts
from gateway.replicas.scrape import DEFAULT_WINDOW_S
from predictor import FitReport, Forecast
from replay.emulated import EmulatedReplica
from replay.loop import Fleet, IdleHooks, VirtualTimeLoop
from replay.requests import FleetConfig, GatewayRequest, gateway_requests
from replay.traces import TraceRequest
from simulator.engine import FinishedRequestStats
from simulator.profile import Profile

__all__ = [
    "DispatchObserver",
    "ForecastingRouter",
    "ReplayConfig",
    "ReplayResult",
    "RequestRecord",
    "run_replay",
]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay: the fleet, what the service is told, and the clocks.

    ``profile``: every replica's emulator profile (the ground truth; the service never sees it).
    ``facts``: what the service is told about each replica (what an operator would write).
    ``max_tokens``: the clients' output cap, lowered to ``max_model_len - prompt`` where needed.
    ``scrape_interval_s`` / ``window_s``: as the live scraper's ``interval`` and ``window``.
    ``jitter``: the engines' relative step-time noise. ``seed``: engines' seeds are seed, seed+1...
    """

    profile: Profile
    facts: ReplicaFacts
    replicas: int = 1
    max_tokens: int = 1000
    scrape_interval_s: float = 1.0
    window_s: float = DEFAULT_WINDOW_S
    jitter: float = 0.02
    seed: int = 0
    output_quantile: float = 0.5
    prediction: PredictionConfig | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_tokens < 1:
            raise ValueError("replicas and max_tokens must be >= 1")
        if self.scrape_interval_s <= 0 or self.window_s <= 0:
            raise ValueError("scrape_interval_s and window_s must be > 0")

    def fleet(self) -> FleetConfig:
        """The loop's fleet for this replay (one tenant: forecasts are asked without one)."""
        return FleetConfig(
            profile=self.profile,
            facts=self.facts,
            replicas=self.replicas,
            max_tokens=self.max_tokens,
            scrape_interval_s=self.scrape_interval_s,
            jitter=self.jitter,
            seed=self.seed,
            tenants=1,
            window_s=self.window_s,
        )


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One replayed request: what was predicted at its arrival and what the engine then measured.

    ``ttft_s``: engine arrival -> first token. ``tpot_s``: mean time per output token after the
    first (``None`` with fewer than two tokens), as vLLM's per-request TPOT.
    """

    index: int
    replica: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    forecast: Forecast
    ttft_s: float | None
    tpot_s: float | None
    finished_s: float
    preemptions: int
    #: Requests on the replica (the gateway's in-flight, this one excluded) when it arrived.
    in_flight_at_arrival: int


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Every finished request in arrival order, plus the fits at the end."""

    records: tuple[RequestRecord, ...]
    end_s: float
    steps: int
    scrapes: int
    reports: dict[str, FitReport | None] = field(default_factory=dict)
    describe: dict[str, object] = field(default_factory=dict)


#: Called right after a request was dispatched: (its index, its replica, virtual seconds now).
DispatchObserver = Callable[[int, EmulatedReplica, float], None]


class ForecastingRouter(IdleHooks):
    """The ``GatewayPolicy`` of a forecast replay: no admission, least outstanding, and a forecast
    of every request before it is sent (see the module); ``records`` holds the finished ones.

    ``finish``: how many of the first requests must finish before ``done`` is true.
    ``on_dispatch``: told of every dispatch (e.g. to copy the engine's state then).
    """

    name = "forecasts"

    def __init__(
        self, service: PredictionService, *, finish: int, on_dispatch: DispatchObserver | None = None
    ) -> None:
        self.service = service
        self.finish = finish
        self.on_dispatch = on_dispatch
        self.records: list[RequestRecord] = []
        self._unfinished = finish
        self._sent: dict[int, tuple[Forecast, int]] = {}
        self._fleet: Fleet | None = None

    @property
    def prediction_service(self) -> PredictionService | None:
        return self.service

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("policy not bound to a fleet")
        return self._fleet

    def bind(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def done(self) -> bool:
        """Whether the first ``finish`` requests have all finished."""
        return self._unfinished <= 0

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        fleet = self.fleet
        k = fleet.least_outstanding()
        handle = fleet.replicas[k]
        forecast = self.service.forecast(
            handle.name,
            model=fleet.model,
            tenant=None,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            in_flight=handle.in_flight(),
            now=now,
        )
        self._sent[request.index] = (forecast, handle.outstanding)
        fleet.dispatch(request, k, now)
        if self.on_dispatch is not None:
            self.on_dispatch(request.index, handle.inner, now)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        forecast, in_flight = self._sent.pop(request.index)
        if request.index < self.finish:
            self._unfinished -= 1
        name = self.fleet.replicas[replica].name
        self.records.append(
            RequestRecord(
                index=request.index,
                replica=name,
                arrival_s=request.arrival_s,
                prompt_tokens=request.prompt_tokens,
                output_tokens=stats.generation_tokens,
                max_tokens=request.max_tokens,
                forecast=forecast,
                ttft_s=stats.ttft_s,
                tpot_s=stats.tpot_s,
                finished_s=now,
                preemptions=stats.num_preemptions,
                in_flight_at_arrival=in_flight,
            )
        )
        self.service.on_finished(
            replica=name,
            model=self.fleet.model,
            tenant=None,
            prompt_chars=None,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generation_tokens,
            finished_at=now,
            forecast=forecast,
            ttft_s=stats.ttft_s,
        )


def run_replay(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    service: PredictionService | None = None,
    *,
    finish: int | None = None,
    on_dispatch: DispatchObserver | None = None,
) -> ReplayResult:
    """Replay ``requests`` (arrival order, fitting ``max_model_len``) on ``config``'s fleet.

    Returns the forecast and outcome of every request that finished. Deterministic for a given
    input and config. ``service``: the prediction service to drive (a fresh one from ``config``
    by default). ``finish``: stop once the first ``finish`` requests have finished (default: all);
    later arrivals keep the load up meanwhile, so the last measured requests do not see an
    emptying replica, and whatever is still running then is dropped. ``on_dispatch``: called
    right after each request reached its replica's engine.
    """
    svc = service or PredictionService(output_quantile=config.output_quantile, config=config.prediction)
    count = len(requests) if finish is None else min(finish, len(requests))
    fleet = config.fleet()
    router = ForecastingRouter(svc, finish=count, on_dispatch=on_dispatch)
    loop = VirtualTimeLoop(fleet, router)
    gateway = gateway_requests(requests, fleet, check_fit=False)
    loop.run(gateway, [r.output_tokens for r in requests], router.done)
    records = sorted(router.records, key=lambda rec: rec.index)
    reports = {r.name: svc.report(r.name) for r in loop.fleet.replicas}
    return ReplayResult(tuple(records), loop.now, loop.steps, loop.scrapes, reports, svc.describe())
