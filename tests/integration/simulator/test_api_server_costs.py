"""API-server costs on the live emulator (``python -m simulator --api-*``): the client sees the
per-request work in its TTFT and the per-token framing (on the engine's CPU) in every token gap.

Bounds are generous (wall clock on a shared machine); the exact arithmetic is checked in virtual
time by tests/unit/simulator/test_apiserver.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.integration.simulator.conftest import Emulator, start_emulator, write_profile

pytestmark = pytest.mark.timeout(180)

#: Fixed work per request and framing work per streamed token on the engine's CPU, seconds.
PER_REQUEST_S = 0.3
PER_OUTPUT_TOKEN_S = 0.01
OUTPUT_TOKENS = 20


@pytest.fixture(scope="module")
def emulators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Emulator, Emulator]]:
    directory = tmp_path_factory.mktemp("api-costs")
    profile_path, model = write_profile(directory)
    plain = start_emulator(profile_path, model, directory / "plain.log")
    try:
        costly = start_emulator(
            profile_path,
            model,
            directory / "costly.log",
            "--api-per-request-s",
            str(PER_REQUEST_S),
            "--api-per-output-token-s",
            str(PER_OUTPUT_TOKEN_S),
            "--api-contention",
            "shared",
        )
        try:
            yield plain, costly
        finally:
            costly.stop()
    finally:
        plain.stop()


async def timed_stream(emulator: Emulator) -> tuple[float, float, int]:
    """One streamed completion: (TTFT, time to the last token, tokens), seconds from sending."""
    body = {
        "model": emulator.model,
        "prompt": "tell me a story",
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    tokens, first, last = 0, 0.0, 0.0
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(f"{emulator.base_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.monotonic() - started
                    first = first or now
                    last = now
                    tokens += 1
    return first, last, tokens


def best_of(emulator: Emulator, runs: int = 3) -> tuple[float, float]:
    """The smallest TTFT and the smallest first-to-last token time over ``runs`` requests."""
    results = [asyncio.run(timed_stream(emulator)) for _ in range(runs)]
    assert all(n == OUTPUT_TOKENS for _, _, n in results)
    return min(r[0] for r in results), min(r[1] - r[0] for r in results)


def test_costs_show_in_ttft_and_token_gaps(emulators: tuple[Emulator, Emulator]) -> None:
    plain, costly = emulators
    ttft_off, decode_off = best_of(plain)
    ttft_on, decode_on = best_of(costly)
    # The fixed work precedes the request's first step.
    assert ttft_on - ttft_off > 0.8 * PER_REQUEST_S
    assert ttft_on < ttft_off + PER_REQUEST_S + 2.0
    # Each of the 19 decode steps after the first token waits for one token's framing.
    added = (OUTPUT_TOKENS - 1) * PER_OUTPUT_TOKEN_S
    assert decode_on - decode_off > 0.6 * added
    assert decode_on < decode_off + added + 2.0


def test_costs_are_logged_at_start(emulators: tuple[Emulator, Emulator]) -> None:
    plain, costly = emulators
    assert "API-server costs: 0.3 s per request" in costly.log()
    assert "API-server costs" not in plain.log()


def test_a_negative_cost_is_refused(tmp_path: Path) -> None:
    profile_path, _ = write_profile(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "simulator", "--profile", str(profile_path), "--api-per-request-s", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "bad --api-* value" in done.stderr
