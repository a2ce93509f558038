"""Scheduler state under concurrent load, and aborts when clients vanish, seen through /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.simulator.conftest import MAX_NUM_SEQS, Emulator

pytestmark = pytest.mark.timeout(120)

#: Generous: every wait below normally ends in well under a second.
DEADLINE_S = 30.0


async def scrape(session: aiohttp.ClientSession, emulator: Emulator) -> dict[tuple[str, str], float]:
    """``/metrics`` as {(sample name, finished_reason or ""): value} for the vllm: samples."""
    async with session.get(f"{emulator.base_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:") and "le" not in s.labels:
                samples[(s.name, s.labels.get("finished_reason", ""))] = s.value
    return samples


def value(samples: dict[tuple[str, str], float], name: str, reason: str = "") -> float:
    return samples[(name, reason)]


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


async def test_counters_and_gauges_move_under_concurrent_load(emulator: Emulator) -> None:
    n_requests, max_tokens = 12, 80
    client = AsyncOpenAI(base_url=f"{emulator.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    async with aiohttp.ClientSession() as session:
        await wait_until(lambda: _idle(session, emulator), "an idle replica before the load starts")
        before = await scrape(session, emulator)

        async def one(i: int) -> int:
            out = await client.completions.create(
                model=emulator.model,
                prompt=f"request {i}",
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
            )
            assert out.usage is not None
            return out.usage.completion_tokens

        load = asyncio.gather(*(one(i) for i in range(n_requests)))
        seen_full, seen_waiting = False, False
        while not load.done():
            now = await scrape(session, emulator)
            seen_full |= value(now, "vllm:num_requests_running") == MAX_NUM_SEQS
            seen_waiting |= value(now, "vllm:num_requests_waiting") > 0
            assert value(now, "vllm:num_requests_running") <= MAX_NUM_SEQS
            await asyncio.sleep(0.05)
        assert await load == [max_tokens] * n_requests
        after = await scrape(session, emulator)
    await client.close()

    assert seen_full, "running never reached max_num_seqs"
    assert seen_waiting, "no request ever waited"
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting") == 0

    def delta(name: str, reason: str = "") -> float:
        return value(after, name, reason) - value(before, name, reason)

    assert delta("vllm:generation_tokens_total") == n_requests * max_tokens
    assert delta("vllm:request_success_total", "length") == n_requests
    assert delta("vllm:request_success_total", "abort") == 0
    assert delta("vllm:prompt_tokens_total") > 0
    assert delta("vllm:e2e_request_latency_seconds_count") == n_requests
    assert delta("vllm:time_to_first_token_seconds_count") == n_requests
    assert delta("vllm:inter_token_latency_seconds_count") == n_requests * (max_tokens - 1)
    assert delta("vllm:request_queue_time_seconds_sum") > 0  # some requests queued
    assert delta("vllm:iteration_tokens_total_count") > 0


async def _idle(session: aiohttp.ClientSession, emulator: Emulator) -> bool:
    now = await scrape(session, emulator)
    return value(now, "vllm:num_requests_running") == 0 and value(now, "vllm:num_requests_waiting") == 0


async def _abort_and_free(session: aiohttp.ClientSession, emulator: Emulator, aborts_before: float) -> None:
    async def aborted_and_idle() -> bool:
        now = await scrape(session, emulator)
        return value(now, "vllm:request_success_total", "abort") == aborts_before + 1 and await _idle(
            session, emulator
        )

    await wait_until(aborted_and_idle, "the abort to be counted and the slot freed")


async def test_disconnect_mid_stream_aborts_and_frees_the_slot(emulator: Emulator) -> None:
    body = {
        "model": emulator.model,
        "prompt": "a long story",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        await wait_until(lambda: _idle(session, emulator), "an idle replica")
        before = await scrape(session, emulator)
        # A separate session, so closing it drops the TCP connection mid-stream.
        async with aiohttp.ClientSession() as streamer:
            resp = await streamer.post(f"{emulator.base_url}/v1/completions", json=body)
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            first = await resp.content.readline()
            assert first.startswith(b"data: {")
            running = await scrape(session, emulator)
            assert value(running, "vllm:num_requests_running") == 1
            resp.close()  # drop the connection without reading the rest
        await _abort_and_free(session, emulator, value(before, "vllm:request_success_total", "abort"))
        after = await scrape(session, emulator)
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert 1 <= generated < 900, "the aborted request kept generating"
    assert value(after, "vllm:request_success_total", "length") == value(
        before, "vllm:request_success_total", "length"
    )


async def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(emulator: Emulator) -> None:
    body = {"model": emulator.model, "prompt": "x", "max_tokens": 900, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        await wait_until(lambda: _idle(session, emulator), "an idle replica")
        before = await scrape(session, emulator)
        async with aiohttp.ClientSession() as requester:
            pending = asyncio.ensure_future(requester.post(f"{emulator.base_url}/v1/completions", json=body))

            async def running() -> bool:
                return value(await scrape(session, emulator), "vllm:num_requests_running") == 1

            await wait_until(running, "the request to run")
            pending.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await pending
        await _abort_and_free(session, emulator, value(before, "vllm:request_success_total", "abort"))
