"""The admission engine's replica port over the replay's fleet (``gateway.admission.ports``).

``FleetPort`` is the ``ReplicaSource`` that ``replay.policies.SluicePolicy`` hands its
``AdmissionEngine``: every replica of the bound ``Fleet`` is healthy and serves the fleet's one
model; a replica that refused a request as overloaded is left alone until its back-off ends, as
the live registry's ``saturate`` does. ``FleetReplica`` is one replica as the engine sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.admission.ports import AdmissionReplica
from replay.loop import Fleet, ReplicaHandle

__all__ = ["FleetPort", "FleetReplica"]


class FleetReplica:
    """A replica of the fleet as the admission engine sees it (``AdmissionReplica``)."""

    __slots__ = ("_handle", "_port")

    def __init__(self, handle: ReplicaHandle, port: FleetPort) -> None:
        self._handle = handle
        self._port = port

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def state(self) -> str:
        return "healthy"

    @property
    def outstanding(self) -> int:
        return self._handle.outstanding

    @property
    def saturated_until(self) -> float:
        return self._port.saturated_until.get(self._handle.name, 0.0)

    def serves(self, model: str, engine: str | None = None) -> bool:
        return model == self._port.model

    def saturated(self, now: float) -> bool:
        return now < self.saturated_until


class FleetPort:
    """``ReplicaSource`` over the replay's fleet (bound to it by ``SluicePolicy.bind``): every
    replica healthy and serving the fleet's model; a replica that refused a request as
    overloaded is left alone until its back-off ends (as the live registry's ``saturate``)."""

    def __init__(self) -> None:
        self.model = ""
        self.saturated_until: dict[str, float] = {}
        self._replicas: list[FleetReplica] = []

    def bind(self, fleet: Fleet) -> None:
        self.model = fleet.model
        self._replicas = [FleetReplica(h, self) for h in fleet.replicas]

    def replicas(self) -> Sequence[AdmissionReplica]:
        return self._replicas

    def get(self, name: str) -> AdmissionReplica | None:
        return next((r for r in self._replicas if r.name == name), None)

    def saturate_named(self, name: str, now: float, back_off_s: float, why: str) -> None:
        self.saturated_until[name] = max(self.saturated_until.get(name, 0.0), now + back_off_s)
