"""The probe of an idle replica that refuses requests on their own targets.

``IdleProbe.probe`` turns a blocked decision into an ``Admit`` to its replica when that replica is
idle, the request fails only its own TTFT or TPOT there, and it has refused such requests for
``PROBE_AFTER_S`` seconds (since it went idle or since its last probe), so that its own steps can
correct a step model a burst taught. ``admitted`` resets a replica's history.
"""

from __future__ import annotations

from typing import Final

from gateway.admission.decision import Admit, Blocker, Decision, Queue, Reject
from gateway.admission.idle import _is_idle
from gateway.admission.slack import _Candidate

#: Seconds an idle replica refuses requests on their own targets (its forecast of them misses)
#: before it takes the next such one anyway, and between two such probes (``IdleProbe.probe``).
PROBE_AFTER_S: Final = 2.0


class IdleProbe:
    """The per-replica history of refusals on idle replicas, and the probe it allows."""

    def __init__(self) -> None:
        #: ``probe``'s history: per idle replica name, since when it has refused requests on
        #: their own targets (or when it was last probed), seconds.
        self._refusing_since: dict[str, float] = {}

    def admitted(self, name: str) -> None:
        """A request was admitted to replica ``name``: its refusal history ends."""
        if self._refusing_since:
            self._refusing_since.pop(name, None)

    def probe(self, candidates: list[_Candidate], now: float, blocked: Queue | Reject) -> Decision:
        """``blocked``, or an ``Admit`` to its replica when that replica is idle (``_is_idle``),
        the request fails only its own targets there (TTFT or TPOT), and the replica has refused
        such requests for ``PROBE_AFTER_S`` since it went idle or since its last probe.

        On an idle replica a forecast is the step model's alone, and the fit learns only from
        traffic: one taught by a burst (a host too busy to step at speed) can refuse everything
        for good, without a Retry-After, on a replica that would serve it. A probe every few
        seconds lets the replica's own steps correct it; it costs an idle replica one request at
        a time. The history is per replica name; an admission or a busy view there resets it."""
        name = blocked.replica
        if not blocked.enforced or name is None or blocked.blocker not in (Blocker.TTFT, Blocker.TPOT):
            return blocked
        for c in candidates:
            if c.view.name == name:
                break
        else:
            return blocked
        if c.slacks is None or not _is_idle(c.view):
            self._refusing_since.pop(name, None)
            return blocked
        since = self._refusing_since.setdefault(name, now)
        if now - since < PROBE_AFTER_S:
            return blocked
        self._refusing_since[name] = now
        return Admit(name, c.forecast, c.slack)
