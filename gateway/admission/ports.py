"""The admission engine's ports and route keys (protocols and pure functions, no state).

What ``AdmissionEngine`` needs of the world: the fleet (``ReplicaSource`` of
``AdmissionReplica``), the prediction service (``PredictionInputs``), where to report
(``EngineLog``) and how to make the in-flight entry of a request it sends (``EntryFactory``).
A route is a model, or a model and the engine a request needs (``route_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from gateway.admission.request import AdmissionRequest
from gateway.admission.views import LiveEntry
from predictor import Forecast, ReplicaState, StepModel
from predictor.correction import Correction

__all__ = [
    "AdmissionReplica",
    "EngineLog",
    "EntryFactory",
    "PredictionInputs",
    "QuietLog",
    "ReplicaSource",
    "route_of",
    "split_route",
]

#: Joins a model and an engine into one route key (a model id never contains a NUL).
_ROUTE_SEP: Final = "\x00"


def route_of(model: str, engine: str | None) -> str:
    """The key admission keeps its controller, queue and views under: the model, plus the engine
    when the request needs one (TGI's native routes). Plain OpenAI requests key by model alone."""
    return model if engine is None else f"{model}{_ROUTE_SEP}{engine}"


def split_route(route: str) -> tuple[str, str | None]:
    """``route_of``'s inverse: (model, engine or ``None``)."""
    model, sep, engine = route.partition(_ROUTE_SEP)
    return model, (engine if sep else None)


class AdmissionReplica(Protocol):
    """A replica as admission sees it (``gateway.replicas.registry.Replica``).

    ``state``: ``"healthy"`` for a replica that may take requests. ``outstanding``: the gateway's
    requests there now. ``saturated_until``: the instant (seconds) until which it asked to be left
    alone after refusing a request as overloaded (its own 429/503)."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def saturated_until(self) -> float: ...

    def serves(self, model: str, engine: str | None = None) -> bool: ...

    def saturated(self, now: float) -> bool: ...


class ReplicaSource(Protocol):
    """The fleet: every replica (``models is None`` when it may serve any model), one by name, and
    the note that one refused a request as overloaded (leave it alone ``back_off_s`` seconds)."""

    def replicas(self) -> Sequence[AdmissionReplica]: ...

    def get(self, name: str) -> AdmissionReplica | None: ...

    def saturate_named(self, name: str, now: float, back_off_s: float, why: str) -> None: ...


class PredictionInputs(Protocol):
    """What admission needs of the prediction service (``PredictionService``)."""

    def replica_inputs(
        self, replica: str, *, model: str, tenant: str | None, in_flight: Sequence[Any], now: float
    ) -> tuple[StepModel, ReplicaState]: ...

    def expected_output(
        self, model: str, tenant: str | None, max_tokens: int | None
    ) -> tuple[float, float]: ...

    def dispatch_overhead_s(self, replica: str) -> float: ...

    def correction(self, replica: str, now: float) -> Correction: ...

    def on_finished(
        self,
        *,
        replica: str,
        model: str,
        tenant: str | None,
        prompt_chars: int | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        finished_at: float | None = None,
        forecast: Forecast | None = None,
        ttft_s: float | None = None,
        api: str | None = None,
        relayed_ttft_s: float | None = None,
        relayed_tpot_s: float | None = None,
    ) -> None: ...


class EngineLog(Protocol):
    """Where the engine reports what an operator should see (a ``logging.Logger`` fits)."""

    def exception(self, msg: str, *args: object) -> None: ...

    def warning(self, msg: str, *args: object) -> None: ...

    def info(self, msg: str, *args: object) -> None: ...


class QuietLog:
    """An ``EngineLog`` that reports nothing."""

    def exception(self, msg: str, *args: object) -> None:
        return None

    def warning(self, msg: str, *args: object) -> None:
        return None

    def info(self, msg: str, *args: object) -> None:
        return None


#: Makes the in-flight entry of a request sent to a replica: (request, now, streamed) -> entry.
EntryFactory = Callable[[AdmissionRequest, float, bool], LiveEntry[Any]]
