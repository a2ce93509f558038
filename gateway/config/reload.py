"""Hot reload: SIGHUP or a changed file -> validate fully -> swap one settings snapshot.

The running configuration only changes by ``SettingsStore.swap`` of a snapshot that passed the
same ``load_settings`` as ``sluice serve`` and ``sluice check-config``; an invalid file is logged
once per change, with every problem, and the running configuration stays. The file (and the keys
file it names) is watched by polling ``os.stat``, acted on once it looks the same on two polls;
SIGHUP always reloads. Keys listed in ``RESTART_ONLY`` (listener addresses, ``limits:`` but
``token_weights``, ...) keep their running values until a restart. Why polling: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.config.load import ConfigError, load_settings, parse_settings
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.tenants import keys_file_path

log = logging.getLogger(__name__)

#: Settings read once at start-up: a reload keeps their running values and logs "requires restart".
RESTART_ONLY: tuple[str, ...] = (
    "server.host",
    "server.port",
    "server.uvloop",
    "server.workers",
    "admin.host",
    "admin.port",
    "emulators",
    "scrape",
    "limits.backend",
    "limits.redis",
    "limits.on_storage_error",
    "limits.expected_gateways",
    "limits.retry_backoff_s",
    "limits.probe_interval_s",
    "limits.lease_ttl_s",
    "limits.over_limit_cache",
    "ledger",
)

#: Restart-only values a log line names without showing them.
_NOT_SHOWN = frozenset({"limits.redis", "scrape"})

#: What ``os.stat`` says about the file: (device, inode, size, mtime ns, ctime ns); ``None`` = absent.
Fingerprint = tuple[int, int, int, int, int] | None
#: The configuration file's fingerprint and its keys file's (``None`` when it names none).
Fingerprints = tuple[Fingerprint, Fingerprint]

Sleep = Callable[[float], Awaitable[None]]


def fingerprint(path: Path) -> Fingerprint:
    """The file's identity and version as seen by ``stat`` (follows symlinks); ``None`` if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _value_at(settings: Settings, dotted: str) -> object:
    value: object = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def restart_only_changes(old: Settings, new: Settings) -> list[str]:
    """The ``RESTART_ONLY`` paths whose values differ between ``old`` and ``new``, in that order."""
    return [path for path in RESTART_ONLY if _value_at(old, path) != _value_at(new, path)]


def keep_restart_only(old: Settings, new: Settings) -> Settings:
    """``new`` with every ``RESTART_ONLY`` value taken from ``old`` (not re-validated)."""
    server = new.server.model_copy(
        update={
            "host": old.server.host,
            "port": old.server.port,
            "uvloop": old.server.uvloop,
            "workers": old.server.workers,
        }
    )
    limits = old.limits.model_copy(update={"token_weights": new.limits.token_weights})
    admin = new.admin.model_copy(update={"host": old.admin.host, "port": old.admin.port})
    return new.model_copy(
        update={
            "server": server,
            "admin": admin,
            "emulators": old.emulators,
            "scrape": old.scrape,
            "limits": limits,
            "ledger": old.ledger,
        }
    )


def changed_sections(old: Settings, new: Settings) -> list[str]:
    """Top-level section names whose values differ, in model order."""
    return [name for name in Settings.model_fields if getattr(old, name) != getattr(new, name)]


def _describe_change(old: Settings, new: Settings, path: str) -> str:
    before, after = _value_at(old, path), _value_at(new, path)
    # Lists are long, and limits.redis holds a URL that may carry a password.
    if isinstance(before, list) or path in _NOT_SHOWN:
        return f"{path} (changed)"
    return f"{path} ({before!r} -> {after!r})"


class ConfigReloader:
    """Reloads the file at ``path`` into ``store`` on SIGHUP and, if ``reload.watch``, on change.

    ``reload.watch`` and ``reload.poll_interval_s`` are read from the store's current snapshot,
    so a reload can turn watching on or off and change the interval. ``sleep`` is injectable
    for tests; it is awaited once per poll with the interval in seconds.
    """

    def __init__(
        self,
        path: str | Path,
        store: SettingsStore,
        *,
        sleep: Sleep = asyncio.sleep,
        on_result: Callable[[bool], None] | None = None,
    ) -> None:
        """``on_result`` is told every reload attempt's outcome: True when the file was valid
        (swapped or unchanged), False when it was rejected (for the reload metrics)."""
        self._path = Path(path)
        self._on_result = on_result
        self._store = store
        self._sleep = sleep
        self._lock = asyncio.Lock()
        self._running = False
        self._subscribed = False
        self._sighup_installed = False
        self._poller: asyncio.Task[None] | None = None
        self._signal_tasks: set[asyncio.Task[bool]] = set()
        # The file versions last loaded or rejected, and ones seen once but not yet stable.
        self._seen: Fingerprints = (None, None)
        self._pending: Fingerprints | None = None

    @property
    def path(self) -> Path:
        return self._path

    def keys_path(self) -> Path | None:
        """The keys file the running configuration names (relative to the config file's directory)."""
        return keys_file_path(self._store.current.tenants, self._path.parent)

    def _fingerprints(self) -> Fingerprints:
        keys = self.keys_path()
        return fingerprint(self._path), None if keys is None else fingerprint(keys)

    async def start(self) -> None:
        """Install the SIGHUP handler and, when ``reload.watch`` is true, start polling."""
        if self._running:
            return
        self._seen = self._fingerprints()
        self._pending = None
        self._running = True
        if not self._subscribed:
            # A swap may flip reload.watch; SettingsStore has no unsubscribe, hence the flag.
            self._store.subscribe(lambda _old, _new: self._reconcile_poller())
            self._subscribed = True
        self._install_sighup()
        self._reconcile_poller()

    async def stop(self) -> None:
        """Remove the SIGHUP handler and cancel polling and in-flight signal reloads."""
        self._running = False
        self._remove_sighup()
        tasks: list[asyncio.Task[None] | asyncio.Task[bool]] = [*self._signal_tasks]
        if self._poller is not None:
            tasks.append(self._poller)
            self._poller = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def reload_now(self) -> bool:
        """Load and validate the file; swap it in if valid and different. True when swapped."""
        async with self._lock:
            self._seen = self._fingerprints()
            self._pending = None
            try:
                loaded = await asyncio.to_thread(load_settings, self._path)
            except ConfigError as exc:
                self._rejected(exc)
                return False
            return self._apply(loaded)

    def _rejected(self, exc: ConfigError) -> None:
        log.error("config reload rejected, keeping the running configuration: %s", exc)
        self._report(False)

    def _report(self, ok: bool) -> None:
        if self._on_result is not None:
            try:
                self._on_result(ok)
            except Exception:
                log.exception("reload result callback failed")

    def _apply(self, loaded: Settings) -> bool:
        old = self._store.current
        restart = restart_only_changes(old, loaded)
        if restart:
            log.warning(
                "config %s: change requires restart, keeping the running value of %s",
                self._path,
                ", ".join(_describe_change(old, loaded, path) for path in restart),
            )
        try:
            # Kept values come from another snapshot, so the whole-file rules must be rechecked.
            new = parse_settings(
                keep_restart_only(old, loaded).model_dump(), f"{self._path} (restart-only values kept)"
            )
        except ConfigError as exc:
            self._rejected(exc)
            return False
        self._report(True)
        sections = changed_sections(old, new)
        if not sections:
            log.info("config %s reloaded: nothing to change", self._path)
            return False
        self._store.swap(new)
        log.info(
            "config %s reloaded (generation %d): changed sections: %s",
            self._path,
            self._store.generation,
            ", ".join(sections),
        )
        return True

    # -- polling -------------------------------------------------------------------------------

    def _reconcile_poller(self) -> None:
        wanted = self._running and self._store.current.reload.watch
        if wanted and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="sluice-config-watch")
        elif not wanted and self._poller is not None:
            self._poller.cancel()
            self._poller = None

    async def _poll(self) -> None:
        while True:
            await self._sleep(self._store.current.reload.poll_interval_s)
            try:
                await self._poll_once()
            except Exception:
                log.exception("config watch of %s failed; will retry", self._path)

    async def _poll_once(self) -> None:
        current = self._fingerprints()
        if current == self._seen:
            self._pending = None
            return
        if current[0] is None:
            log.warning(
                "config file %s is missing or unreadable; keeping the running configuration", self._path
            )
            self._seen = current
            return
        if current != self._pending:
            self._pending = current  # wait one more poll so a writer can finish
            return
        await self.reload_now()

    # -- SIGHUP --------------------------------------------------------------------------------

    def _install_sighup(self) -> None:
        sighup = getattr(signal, "SIGHUP", None)
        if sighup is None:
            return
        try:
            asyncio.get_running_loop().add_signal_handler(sighup, self._on_sighup)
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            log.warning("SIGHUP reload unavailable (%s); file watching still works", exc)
            return
        self._sighup_installed = True

    def _remove_sighup(self) -> None:
        if self._sighup_installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup_installed = False

    def _on_sighup(self) -> None:
        log.info("SIGHUP: reloading %s", self._path)
        task = asyncio.get_running_loop().create_task(self._reload_logged(), name="sluice-config-sighup")
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)

    async def _reload_logged(self) -> bool:
        try:
            return await self.reload_now()
        except Exception:
            log.exception("config reload of %s failed", self._path)
            return False
