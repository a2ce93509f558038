"""The one place the running configuration lives: an immutable snapshot, swapped whole."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.config.settings import Settings

log = logging.getLogger(__name__)

#: Called after a swap with (old, new); must not raise (errors are logged and ignored).
Subscriber = Callable[[Settings, Settings], None]


class SettingsStore:
    """Holds the current ``Settings``; readers take ``store.current`` once per request.

    Swapping is a single reference assignment, so a request sees either the old snapshot or the
    new one, never a mix. Subscribers (the replica registry, the logger) reconcile after a swap.
    """

    def __init__(self, initial: Settings) -> None:
        self._current = initial
        self._subscribers: list[Subscriber] = []
        self.generation = 0

    @property
    def current(self) -> Settings:
        return self._current

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)

    def swap(self, new: Settings) -> None:
        old, self._current = self._current, new
        self.generation += 1
        for callback in self._subscribers:
            try:
                callback(old, new)
            except Exception:
                log.exception("settings subscriber %r failed", callback)
