"""Active health checks: ``GET /health`` on every replica each ``health.interval_s`` seconds.

One round checks all replicas concurrently, each within ``health.timeout_s``; 2xx is a success,
anything else a failure. A replica not yet healthy must also answer ``GET /v1/models`` (cached for
routing). Unhealthy replicas are probed with backoff up to ``max_backoff_s``; ejected ones not
until their ejection ends. Settings are read each round, so reloads apply at once; ``poke()``
starts the next round early. ``on_models`` listeners hear of changed model lists, ``on_state``
listeners of health transitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway.api.responses import ModelCard, parse_models
from gateway.config.store import SettingsStore
from gateway.replicas.dialects.info import fill_context_length
from gateway.replicas.registry import Replica, ReplicaRegistry, ReplicaState

log = logging.getLogger("sluice.health")


async def probe(session: aiohttp.ClientSession, replica: Replica, timeout_s: float) -> str | None:
    """``GET {replica}/health``; ``None`` when it answered 2xx, else why not (one short line)."""
    try:
        async with session.get(
            replica.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await resp.read()
            return None if 200 <= resp.status < 300 else f"/health answered {resp.status}"
    except TimeoutError:
        return f"/health timed out after {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        return f"/health failed: {exc.__class__.__name__}: {exc}"


async def fetch_models(
    session: aiohttp.ClientSession, replica: Replica, timeout_s: float
) -> dict[str, ModelCard] | str:
    """``GET {replica}/v1/models`` parsed into cards by id, or why it failed (one short line).

    A card without ``max_model_len`` gets the one the engine's info endpoint states (TGI ``/info``,
    SGLang ``/get_server_info``: ``gateway.replicas.dialects.info``)."""
    try:
        async with session.get(
            replica.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return f"/v1/models answered {resp.status}"
            cards = parse_models(await resp.json(content_type=None))
        # TGI's list (and some SGLang's) has no max_model_len: its info endpoint has it.
        return await fill_context_length(session, replica.base_url, replica.engine, cards, timeout_s)
    except TimeoutError:
        return f"/v1/models timed out after {timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        return f"/v1/models failed: {exc.__class__.__name__}: {exc}"


class HealthChecker:
    """Runs check rounds forever (``run``), or one at a time (``check_all``, used at startup)."""

    def __init__(
        self, store: SettingsStore, registry: ReplicaRegistry, session: aiohttp.ClientSession
    ) -> None:
        self._store = store
        self._registry = registry
        self._session = session
        self._poked = asyncio.Event()
        self._model_listeners: list[Callable[[Replica], None]] = []
        self._state_listeners: list[Callable[[Replica], None]] = []

    def on_models(self, listener: Callable[[Replica], None]) -> None:
        """Call ``listener(replica)`` whenever a replica's model list is fetched and differs from
        the one it had (errors are logged, never raised)."""
        self._model_listeners.append(listener)

    def on_state(self, listener: Callable[[Replica], None]) -> Callable[[], None]:
        """Call ``listener(replica)`` whenever a check moves a replica between healthy and
        unhealthy (admission re-evaluates its queue: a replica back may take what waits; errors
        are logged, never raised). Returns the call that stops it."""
        self._state_listeners.append(listener)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._state_listeners.remove(listener)

        return stop

    def poke(self) -> None:
        """Start the next round now instead of at the end of the interval."""
        self._poked.set()

    async def check_all(self) -> None:
        """One round over every configured replica; returns when all checks are done."""
        await asyncio.gather(*(self.check(r) for r in self._registry.replicas()))

    async def check_due(self) -> None:
        """One round over the replicas whose check is due (healthy ones always; unhealthy ones
        when their backoff or ejection has passed)."""
        now = time.monotonic()
        due = [r for r in self._registry.replicas() if now >= max(r.next_check_at, r.ejected_until)]
        await asyncio.gather(*(self.check(r) for r in due))

    async def check(self, replica: Replica) -> ReplicaState | None:
        """Check one replica and record the result; returns the new state if it changed."""
        health = self._store.current.health
        error = await probe(self._session, replica, health.timeout_s)
        if error is None and (replica.state != ReplicaState.HEALTHY or replica.models is None):
            models = await fetch_models(self._session, replica, health.timeout_s)
            if isinstance(models, str):
                error = models
            elif models != replica.models:
                replica.models = models
                self._models_changed(replica)
        if replica.retired:
            return None
        changed = replica.record(error is None, health, error=error)
        if changed is not None:
            self._notify(self._state_listeners, replica, "state")
        if replica.state == ReplicaState.HEALTHY or error is None:
            replica.next_check_at = 0.0
        else:
            beyond = max(0, replica.consecutive_failures - health.unhealthy_after)
            wait = min(health.max_backoff_s, health.interval_s * 2.0 ** min(beyond, 30))
            replica.next_check_at = time.monotonic() + wait
        return changed

    def _models_changed(self, replica: Replica) -> None:
        self._notify(self._model_listeners, replica, "model-list")

    @staticmethod
    def _notify(listeners: list[Callable[[Replica], None]], replica: Replica, what: str) -> None:
        for listener in list(listeners):
            try:
                listener(replica)
            except Exception:
                log.exception("%s listener %r failed for replica %s", what, listener, replica.name)

    async def run(self) -> None:
        """Check every ``health.interval_s`` seconds (or sooner when poked) until cancelled.

        The first round comes one interval (or a poke) after the call: startup runs
        ``check_all`` itself before serving.
        """
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), self._store.current.health.interval_s)
            try:
                await self.check_due()
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")
            # Pokes that arrived during the round were answered by it; clearing after the round
            # keeps a burst of proxy errors from turning into back-to-back rounds.
            self._poked.clear()
