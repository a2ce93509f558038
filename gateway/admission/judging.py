"""``AttainmentJudge``: when each request sent to a replica counts towards its class's attainment.

A request still without a first token when its first-token deadline passes has missed, whatever
comes next: it is judged then (``due``), not when its late stream ends, which in a burst is
seconds later. Every other request is judged when it ends (``ended``), its TPOT known too; a miss
judged early records only how long it lasted then. A request its replica refused is not one to
judge (``withdraw``: a verdict it had is retracted). The verdicts go to the
``AttainmentController``; a margin that moves is reported through ``moved`` (the engine rebuilds
that replica's views). Times are the caller's clock, seconds; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.admission.attainment import AttainmentController, Verdict, met_targets
from gateway.admission.config import AdmissionSettings, ClassSettings
from gateway.admission.request import AdmissionRequest
from gateway.admission.results import Ending
from gateway.admission.views import LiveEntry

__all__ = ["AttainmentJudge", "class_of"]


def class_of(settings: AdmissionSettings, request: AdmissionRequest) -> tuple[str, ClassSettings]:
    """The class ``request`` is judged in (its own when configured, else the default) and its settings."""
    name = request.request_class if request.request_class in settings.classes else settings.default_class
    return name, settings.classes[name]


@dataclass(slots=True)
class _Sent:
    replica: str
    entry: LiveEntry[Any]
    request: AdmissionRequest
    deadline: float
    #: A miss judged at its deadline (``None``: not judged yet).
    verdict: Verdict | None = None


class AttainmentJudge:
    """Judges the requests sent to replicas for ``controller`` (see the module).

    ``settings``: the ``admission`` section in force (read at each judgement: a hot reload's
    classes apply to the requests judged after it). ``moved``: called with a replica's name when
    a judgement moved a margin there.
    """

    def __init__(
        self,
        controller: AttainmentController,
        settings: Callable[[], AdmissionSettings],
        moved: Callable[[str], None],
    ) -> None:
        self._controller = controller
        self._settings = settings
        self._moved = moved
        self._sent: dict[int, _Sent] = {}
        #: (first-token deadline, key) of the requests in ``_sent``, earliest first.
        self._deadlines: list[tuple[float, int]] = []

    def sent(self, key: int, replica: str, entry: LiveEntry[Any], request: AdmissionRequest) -> None:
        """Request ``key`` was sent to ``replica``; ``entry`` is where its tokens are marked."""
        deadline = request.first_token_deadline_s(class_of(self._settings(), request)[1])
        self._sent[key] = _Sent(replica, entry, request, deadline)
        heapq.heappush(self._deadlines, (deadline, key))

    def due(self, now: float) -> None:
        """Judge every request whose first-token deadline has passed by ``now`` without a first
        token, or with a late one, as a miss."""
        deadlines, sent_by_key = self._deadlines, self._sent
        while deadlines and deadlines[0][0] <= now:
            deadline, key = heapq.heappop(deadlines)
            sent = sent_by_key.get(key)
            if sent is None or sent.verdict is not None:
                continue
            first = sent.entry.first_token_at
            if first is not None and first <= deadline:
                continue  # met its first target: judged at its end, with its TPOT
            name, _ = class_of(self._settings(), sent.request)
            sent.verdict = self._judge(name, sent.replica, sent.entry.started_at, now, False)

    def ended(self, key: int, ending: Ending, now: float) -> None:
        """Request ``key`` ended at ``now`` as ``ending`` says: judged now, with its TPOT (not
        counted without a first token), unless it was judged a miss at its deadline."""
        sent = self._sent.pop(key, None)
        if sent is None:
            return
        request, entry, replica = sent.request, sent.entry, sent.replica
        name, cls = class_of(self._settings(), request)
        if sent.verdict is not None:
            self._controller.lasted(name, replica, entry.started_at, now)
            return
        first = entry.first_token_at
        if first is None:
            return
        _, tpot = ending.relayed(entry)
        met = met_targets(first, request.first_token_deadline_s(cls), tpot, cls.tpot_target_s)
        self._judge(name, replica, entry.started_at, now, met)
        self._controller.lasted(name, replica, entry.started_at, now)

    def withdraw(self, key: int) -> None:
        """Request ``key`` is not one to judge (its replica refused it): forget it, and retract
        the miss it was judged if any."""
        sent = self._sent.pop(key, None)
        if sent is not None and sent.verdict is not None:
            self._controller.retract(sent.verdict, class_of(self._settings(), sent.request)[0], sent.replica)

    def _judge(self, name: str, replica: str, admitted_at: float, now: float, met: bool) -> Verdict:
        """The controller's ``judge``, telling ``moved`` when it moved ``name``'s margin on
        ``replica``."""
        controller = self._controller
        before = controller.margin(name, replica, now)
        verdict = controller.judge(name, replica, admitted_at, now, met)
        if controller.margin(name, replica, now) != before:
            self._moved(replica)
        return verdict
