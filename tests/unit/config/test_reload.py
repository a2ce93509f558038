"""ConfigReloader against a real file, a real SettingsStore and a real SIGHUP.

Waiting is on events (a store subscriber, a log handler, a counting sleep) with generous
timeouts; nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from gateway.config.load import load_settings
from gateway.config.reload import ConfigReloader
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from tests.support.skips import skip_or_fail

#: Generous: a loaded 2-core CI machine must never time out a poll of a few milliseconds.
WAIT_S = 20.0
POLL_S = 0.01


def config_text(
    *,
    interval_s: float = 2.0,
    port: int = 8080,
    emulator_port: int = 8101,
    watch: bool = True,
    level: str = "INFO",
    replica: str = "r0",
    emulator: str = "emu-0",
) -> str:
    return f"""\
server:
  port: {port}
replicas:
  - name: {replica}
    url: http://127.0.0.1:8000
emulators:
  - name: {emulator}
    port: {emulator_port}
health:
  interval_s: {interval_s}
reload:
  watch: {str(watch).lower()}
  poll_interval_s: {POLL_S}
logging:
  level: {level}
"""


class Swaps:
    """A store subscriber that records swaps and lets a test wait for the next one."""

    def __init__(self, store: SettingsStore) -> None:
        self.seen: list[tuple[Settings, Settings]] = []
        self._event = asyncio.Event()
        store.subscribe(self._on_swap)

    def _on_swap(self, old: Settings, new: Settings) -> None:
        self.seen.append((old, new))
        self._event.set()

    async def next(self) -> Settings:
        await asyncio.wait_for(self._event.wait(), WAIT_S)
        self._event.clear()
        return self.seen[-1][1]


class LogWatch(logging.Handler):
    """Collects gateway.config.reload records; a test can wait for one containing some text."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._waiters: list[tuple[Callable[[logging.LogRecord], bool], asyncio.Event]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        for predicate, event in self._waiters:
            if predicate(record):
                event.set()

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]

    async def wait_for(self, level: int, text: str) -> None:
        event = asyncio.Event()
        self._waiters.append((lambda r: r.levelno == level and text in r.getMessage(), event))
        if any(text in m for m in self.messages(level)):
            return
        await asyncio.wait_for(event.wait(), WAIT_S)


class CountingSleep:
    """Real (short) sleeps, counted, so a test can wait until the poller has run N more times."""

    def __init__(self) -> None:
        self.calls = 0
        self._changed = asyncio.Condition()

    async def __call__(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        async with self._changed:
            self.calls += 1
            self._changed.notify_all()

    async def polls(self, count: int) -> None:
        target = self.calls + count
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.calls >= target), WAIT_S)


@pytest.fixture
def logs() -> Iterator[LogWatch]:
    handler = LogWatch()
    logger = logging.getLogger("gateway.config.reload")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "sluice.yaml"
    path.write_text(config_text())
    return path


@pytest.fixture
def store(config_path: Path) -> SettingsStore:
    return SettingsStore(load_settings(config_path))


@pytest.fixture
def sleep() -> CountingSleep:
    return CountingSleep()


@pytest.fixture
async def reloader(
    config_path: Path, store: SettingsStore, sleep: CountingSleep
) -> AsyncIterator[ConfigReloader]:
    reloader = ConfigReloader(config_path, store, sleep=sleep)
    await reloader.start()
    yield reloader
    await reloader.stop()


def write_config(path: Path, text: str) -> None:
    """Rewrite in place (open with truncate, write), as ``echo > file`` does. Tiny, so blocking is fine."""
    path.write_text(text)


def remove_config(path: Path) -> None:
    path.unlink()


def replace_atomically(path: Path, text: str) -> None:
    """What vim, VS Code and Kubernetes do: write a new file, then rename it over the old one."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


# -- reload_now: one call, one outcome ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("new_text", "swapped", "expected", "log_level", "log_text"),
    [
        (config_text(), False, {"health.interval_s": 2.0}, logging.INFO, "nothing to change"),
        (
            config_text(interval_s=3.0, level="DEBUG"),
            True,
            {"health.interval_s": 3.0, "logging.level": "DEBUG"},
            logging.INFO,
            "changed sections: health, logging",
        ),
        (
            config_text(port=9090, emulator_port=8201),
            False,
            {"server.port": 8080, "emulators.0.port": 8101},
            logging.WARNING,
            "requires restart, keeping the running value of server.port (8080 -> 9090), emulators (changed)",
        ),
        (
            config_text(port=9090, interval_s=5.0),
            True,
            {"server.port": 8080, "health.interval_s": 5.0},
            logging.WARNING,
            "server.port (8080 -> 9090)",
        ),
        (
            "server:\n  prot: 1\n",
            False,
            {"health.interval_s": 2.0},
            logging.ERROR,
            "2 problems in configuration\n  server.prot: unknown key; did you mean 'port'? (got 1)\n"
            "  replicas: at least one entry",
        ),
        (
            # Valid alone, but the kept emulator emu-0 would share a name with the new replica.
            config_text(replica="emu-0", emulator="emu-1"),
            False,
            {"replicas.0.name": "r0"},
            logging.ERROR,
            "(restart-only values kept): 1 problem in configuration\n"
            "  emulators.0.name: duplicate name, first used at replicas.0.name (got 'emu-0')",
        ),
        (None, False, {"health.interval_s": 2.0}, logging.ERROR, "file not found"),
    ],
    ids=[
        "unchanged",
        "sections_changed",
        "only_restart_fields",
        "restart_fields_kept_others_applied",
        "invalid_file",
        "invalid_with_kept_values",
        "missing_file",
    ],
)
async def test_reload_now(
    config_path: Path,
    store: SettingsStore,
    logs: LogWatch,
    new_text: str | None,
    swapped: bool,
    expected: dict[str, object],
    log_level: int,
    log_text: str,
) -> None:
    before = store.current
    if new_text is None:
        remove_config(config_path)
    else:
        write_config(config_path, new_text)
    reloader = ConfigReloader(config_path, store)

    assert await reloader.reload_now() is swapped

    assert store.generation == (1 if swapped else 0)
    assert (store.current is before) is not swapped
    for dotted, value in expected.items():
        assert _attribute(store.current, dotted) == value
    assert any(log_text in m for m in logs.messages(log_level)), logs.messages(log_level)


def _attribute(settings: Settings, dotted: str) -> object:
    value: object = settings
    for part in dotted.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)  # type: ignore[index]
    return value


# -- watching the file -------------------------------------------------------------------------------


async def test_file_change_swaps(config_path: Path, store: SettingsStore, reloader: ConfigReloader) -> None:
    swaps = Swaps(store)
    write_config(config_path, config_text(interval_s=3.25))

    new = await swaps.next()

    assert new.health.interval_s == 3.25
    assert store.current is new
    assert store.generation == 1


async def test_invalid_change_keeps_old_and_logs_once(
    config_path: Path, store: SettingsStore, reloader: ConfigReloader, logs: LogWatch, sleep: CountingSleep
) -> None:
    swaps = Swaps(store)
    before = store.current
    write_config(config_path, config_text(interval_s=-1.0) + "bogus: 1\n")

    await logs.wait_for(logging.ERROR, "config reload rejected")
    await sleep.polls(10)  # the poller keeps running and must not repeat itself

    assert store.current is before
    errors = logs.messages(logging.ERROR)
    assert len(errors) == 1
    assert "health.interval_s: Input should be greater than 0 (got -1.0)" in errors[0]
    assert "bogus: unknown key (got 1)" in errors[0]

    write_config(config_path, config_text(interval_s=4.0))
    assert (await swaps.next()).health.interval_s == 4.0
    assert len(logs.messages(logging.ERROR)) == 1


async def test_atomic_rename_is_seen(
    config_path: Path, store: SettingsStore, reloader: ConfigReloader
) -> None:
    swaps = Swaps(store)
    replace_atomically(config_path, config_text(interval_s=6.0))

    assert (await swaps.next()).health.interval_s == 6.0


async def test_file_briefly_missing_keeps_config(
    config_path: Path, store: SettingsStore, reloader: ConfigReloader, logs: LogWatch, sleep: CountingSleep
) -> None:
    swaps = Swaps(store)
    before = store.current
    remove_config(config_path)

    await logs.wait_for(logging.WARNING, "is missing or unreadable")
    await sleep.polls(5)
    assert store.current is before
    assert len(logs.messages(logging.WARNING)) == 1

    write_config(config_path, config_text(interval_s=7.0))
    assert (await swaps.next()).health.interval_s == 7.0
    assert logs.messages(logging.ERROR) == []


async def test_reload_turns_watching_off_and_on(
    config_path: Path, store: SettingsStore, reloader: ConfigReloader
) -> None:
    swaps = Swaps(store)
    write_config(config_path, config_text(watch=False, interval_s=3.0))
    assert (await swaps.next()).reload.watch is False
    assert await _watch_tasks_settle(want=0) == 0

    write_config(config_path, config_text(watch=True, interval_s=8.0))
    assert await reloader.reload_now()  # the file is still read on demand (SIGHUP)
    assert await _watch_tasks_settle(want=1) == 1


async def _watch_tasks_settle(want: int) -> int:
    """Live poll tasks, after letting the loop run a bounded number of turns (no timed sleeps)."""
    for _ in range(1000):
        live = [t for t in asyncio.all_tasks() if t.get_name() == "sluice-config-watch" and not t.done()]
        if len(live) == want:
            break
        await asyncio.sleep(0)
    return len(live)


# -- SIGHUP ------------------------------------------------------------------------------------------


async def test_sighup_reloads(tmp_path: Path, logs: LogWatch) -> None:
    if not hasattr(signal, "SIGHUP"):
        skip_or_fail("this platform has no SIGHUP", install="run the suite on Linux or macOS")
    path = tmp_path / "sluice.yaml"
    write_config(path, config_text(watch=False))  # only the signal can trigger a reload
    store = SettingsStore(load_settings(path))
    swaps = Swaps(store)
    sleep = CountingSleep()
    reloader = ConfigReloader(path, store, sleep=sleep)
    await reloader.start()
    try:
        write_config(path, config_text(watch=False, interval_s=9.0))
        os.kill(os.getpid(), signal.SIGHUP)
        assert (await swaps.next()).health.interval_s == 9.0
    finally:
        await reloader.stop()
    assert sleep.calls == 0  # watch: false means no polling at all
    assert any("SIGHUP" in m for m in logs.messages(logging.INFO))


@pytest.mark.parametrize(
    ("new_text", "results"),
    [
        pytest.param(config_text(interval_s=3.0), [True], id="valid_change"),
        pytest.param(config_text(), [True], id="valid_unchanged"),
        pytest.param("server: [", [False], id="invalid_yaml"),
        pytest.param(config_text(interval_s=-1.0), [False], id="invalid_value"),
    ],
)
async def test_reload_reports_each_attempt(
    config_path: Path, store: SettingsStore, new_text: str, results: list[bool]
) -> None:
    seen: list[bool] = []
    write_config(config_path, new_text)
    reloader = ConfigReloader(config_path, store, on_result=seen.append)
    await reloader.reload_now()
    assert seen == results
