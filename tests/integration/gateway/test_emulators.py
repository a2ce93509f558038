"""Emulator child processes: start, wait for /health, stop by process group; real processes.

Most cases use a tiny fake emulator script (``FAKE_EMULATOR``) because the faults tested (exiting
at once, never answering, ignoring SIGTERM) cannot be asked of the real emulator; the last tests
run the real ``python -m simulator`` behind the gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import EMULATORS, OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import EmulatorSettings, HealthSettings
from gateway.replicas.emulators import (
    EmulatorStartError,
    emulator_command,
    start_emulators,
    stop_emulators,
)
from tests.support.procs import ROOT, free_port, port_is_open

FAKE_EMULATOR = textwrap.dedent(
    """
    import os, signal, sys, time
    from aiohttp import web

    mode, port = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as pidfile:
            pidfile.write(str(os.getpid()))
    print("fake emulator starting in mode", mode, flush=True)
    print("a line on stderr", file=sys.stderr, flush=True)
    if mode == "exit":
        sys.exit(3)
    if mode == "never-ready":
        time.sleep(120)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=mode != "ignore-term")
    """
)


def fake_command(mode: str, pidfile: Path | None = None):
    def command(emulator: EmulatorSettings) -> list[str]:
        extra = [str(pidfile)] if pidfile is not None else []
        return [sys.executable, "-c", FAKE_EMULATOR, mode, str(emulator.port), *extra]

    return command


def pids_in(folder: Path) -> list[int]:
    """The pids the fake emulators wrote (one that was stopped early may not have written yet)."""
    texts = [path.read_text() for path in folder.glob("*.pid")]
    return [int(text) for text in texts if text]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def emulator(name: str = "emu1", **kw: object) -> EmulatorSettings:
    return EmulatorSettings(name=name, port=free_port(), **kw)  # type: ignore[arg-type]


def test_emulator_command() -> None:
    settings = EmulatorSettings(name="e", profile="p", port=8001, host="0.0.0.0", seed=4, jitter=0.1)
    assert emulator_command(settings) == [
        sys.executable, "-m", "simulator", "--profile", "p", "--port", "8001", "--host", "0.0.0.0",
        "--seed", "4", "--enable-prompt-tokens-details", "--jitter", "0.1", "--parent-pid",
        str(os.getpid()),
    ]  # fmt: skip
    assert "--seed" not in emulator_command(EmulatorSettings(name="e", port=8001))
    # TGI's and SGLang's faces have no such flag.
    tgi = emulator_command(EmulatorSettings(name="e", port=8001, engine="tgi"))
    assert "--enable-prompt-tokens-details" not in tgi


async def test_start_waits_for_health_and_stop_terminates_the_group() -> None:
    settings = [emulator("a"), emulator("b")]
    async with aiohttp.ClientSession() as session:
        processes = await start_emulators(settings, session, command=fake_command("serve"))
        assert all(port_is_open(s.port) for s in settings)
        assert all(os.getpgid(p.process.pid) == p.process.pid for p in processes)  # own group

        await stop_emulators(processes)

    assert all(p.process.returncode is not None for p in processes)
    assert not any(port_is_open(s.port) for s in settings)


async def test_an_emulator_ignoring_sigterm_is_killed_after_the_grace_period() -> None:
    settings = emulator()
    async with aiohttp.ClientSession() as session:
        (process,) = await start_emulators([settings], session, command=fake_command("ignore-term"))
        started = time.monotonic()
        code = await process.stop(grace_s=0.5)

    assert code == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5


@pytest.mark.parametrize(
    ("mode", "with_good", "timeout_s", "what"),
    [
        pytest.param(
            "exit", True, 60.0, "exited with code 3 before answering /health", id="exits-at-once-next-to-good"
        ),
        pytest.param("never-ready", False, 1.5, "did not answer", id="never-answers"),
    ],
)
async def test_start_failure_names_the_emulator_and_shows_its_output(
    mode: str, with_good: bool, timeout_s: float, what: str, tmp_path: Path
) -> None:
    good, bad = emulator("good"), emulator("broken")
    commands = {
        "good": fake_command("serve", tmp_path / "good.pid"),
        "broken": fake_command(mode, tmp_path / "broken.pid"),
    }
    chosen = [good, bad] if with_good else [bad]

    async with aiohttp.ClientSession() as session:
        with pytest.raises(EmulatorStartError) as caught:
            await start_emulators(
                chosen, session, command=lambda e: commands[e.name](e), ready_timeout_s=timeout_s
            )

    message = str(caught.value)
    assert "'broken'" in message
    assert what in message
    assert "a line on stderr" in message
    assert f"mode {mode}" in message
    # Everything started is stopped, even the good one that may not have been ready yet.
    assert not any(is_running(pid) for pid in pids_in(tmp_path))
    assert not port_is_open(good.port)


async def test_real_emulator_behind_the_gateway(aiohttp_client) -> None:
    """The real ``python -m simulator`` started by the app, used through it, stopped with it."""
    settings = Settings(
        emulators=[emulator("sim", profile="llama3-8b-h100", seed=1)],
        health=HealthSettings(interval_s=30.0, timeout_s=2.0),
    )
    app = build_app(SettingsStore(settings))
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    client = await aiohttp_client(app)
    (process,) = app[EMULATORS]

    models = (await (await client.get("/v1/models")).json())["data"]
    (model,) = models
    assert model["max_model_len"] > 0
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": model["id"],
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 4,
        },
    )
    body = await resp.text()
    assert resp.status == 200
    datas = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    assert all(json.loads(d)["choices"] for d in datas[:-1]), "no usage chunk: the client did not ask"
    assert outcomes[0].completion_tokens == 4
    assert (outcomes[0].prompt_tokens or 0) > 0
    assert outcomes[0].ttft_s is not None

    await client.close()
    assert process.process.returncode is not None
    assert not port_is_open(settings.emulators[0].port)


RUN_GATEWAY = textwrap.dedent(
    """
    import sys
    from gateway.serve import run_gateway
    from gateway.observability.logs import configure_logging
    from gateway.config.settings import ServerSettings, Settings
    from gateway.replicas.config import EmulatorSettings
    from gateway.config.store import SettingsStore

    settings = Settings(
        server=ServerSettings(port=int(sys.argv[1]), shutdown_grace_s=2.0),
        emulators=[EmulatorSettings(name="sim", port=int(sys.argv[2]), profile="llama3-8b-h100")],
    )
    configure_logging(settings.logging)
    run_gateway(SettingsStore(settings))
    """
)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _run_gateway_with_an_emulator() -> tuple[subprocess.Popen[str], int]:
    """``RUN_GATEWAY`` started and ready (60 s at most), its emulator listening; the process and
    the emulator's port."""
    gateway_port, emulator_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_GATEWAY, str(gateway_port), str(emulator_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _ready(gateway_port):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "gateway not ready in 60 s"
            time.sleep(0.2)
        assert port_is_open(emulator_port)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, emulator_port


@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGTERM, id="sigterm"), pytest.param(signal.SIGINT, id="ctrl-c")]
)
def test_stopping_run_gateway_stops_the_emulators_it_started(sig: signal.Signals) -> None:
    proc, emulator_port = _run_gateway_with_an_emulator()
    try:
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert proc.returncode == 0, output
    assert not port_is_open(emulator_port), output
    assert "emulator sim stopped" in output


def test_a_killed_gateway_leaves_no_emulator_running() -> None:
    """SIGKILL gives the gateway no chance to stop its emulators: each stops by itself once its
    parent is gone (``--parent-pid``), so the next start finds its ports free."""
    proc, emulator_port = _run_gateway_with_an_emulator()
    proc.kill()
    output, _ = proc.communicate()

    # Generous: the emulator polls its parent every half second, then drains and exits.
    deadline = time.monotonic() + 30
    while port_is_open(emulator_port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not port_is_open(emulator_port), output


async def test_an_emulator_dying_after_startup_is_logged_with_its_output(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = emulator("dies")
    async with aiohttp.ClientSession() as session:
        (process,) = await start_emulators([settings], session, command=fake_command("serve"))
        with caplog.at_level(logging.WARNING, logger="sluice.emulators"):
            os.kill(process.process.pid, signal.SIGKILL)
            await process.process.wait()
            await asyncio.wait_for(process.output_done(), timeout=5)
        await process.stop()

    (record,) = [r for r in caplog.records if "exited unexpectedly" in r.getMessage()]
    assert "emulator dies exited unexpectedly" in record.getMessage()
    assert "a line on stderr" in record.getMessage()
