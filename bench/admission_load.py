"""Open-loop load through the gateway, measured at the client: what each request saw.

Used by ``tests/integration/admission`` (the spike, the openai SDK retry) and
``bench/rejection_flood.py``. Every request streams a chat completion with ``ignore_eos`` and a
fixed ``max_tokens`` (the emulator then produces exactly that many tokens), and records, on the
client's monotonic clock:

* ``sent_at``: the request was handed to the connection;
* ``answered_at``: the response headers arrived (for a 429 that is the whole answer);
* ``first_token_at`` / ``last_token_at``: first and last content-carrying SSE event;
* ``tokens``: content-carrying events (one per token on the emulator and vLLM).

Open loop: arrivals follow a Poisson process at the given rate whatever the responses do (a
closed loop would slow down exactly when the gateway is overloaded, hiding the spike).
No assertion here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

__all__ = [
    "Phase",
    "Result",
    "chat_body",
    "closed_loop_throughput",
    "open_loop",
    "quantile",
    "send",
]

_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired")


@dataclass(slots=True)
class Result:
    """One request as the client saw it (seconds, ``time.monotonic``)."""

    phase: str
    sent_at: float
    status: int = 0
    answered_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    done_at: float | None = None
    tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Client TTFT: sent -> first token (queue in Sluice included)."""
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per token after the first (``None`` below two tokens)."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.tokens - 1)

    @property
    def answer_s(self) -> float | None:
        """Sent -> response headers (a rejection's whole latency)."""
        return None if self.answered_at is None else self.answered_at - self.sent_at


@dataclass(frozen=True, slots=True)
class Phase:
    """``duration_s`` seconds of Poisson arrivals at ``rate_per_s``, labelled ``name``."""

    name: str
    rate_per_s: float
    duration_s: float


def chat_body(model: str, prompt_words: int, max_tokens: int, rng: random.Random) -> dict[str, object]:
    """A streamed chat request of about ``prompt_words`` words asking for exactly ``max_tokens``."""
    words = " ".join(rng.choice(_WORDS) for _ in range(prompt_words))
    return {
        "model": model,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, object],
    result: Result,
    headers: Mapping[str, str] | None = None,
) -> Result:
    """POST ``body`` to ``url`` + /v1/chat/completions and fill ``result`` as the answer arrives."""
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            result.answered_at = time.monotonic()
            result.status = resp.status
            result.headers = {k.lower(): v for k, v in resp.headers.items()}
            if resp.status != 200:
                await resp.read()
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if _carries_token(line[6:]):
                    now = time.monotonic()
                    result.tokens += 1
                    if result.first_token_at is None:
                        result.first_token_at = now
                    result.last_token_at = now
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{exc.__class__.__name__}: {exc}"
    finally:
        result.done_at = time.monotonic()
    return result


def _carries_token(data: bytes) -> bool:
    if b'"content"' not in data and b'"text"' not in data:
        return False
    try:
        payload = json.loads(data)
    except ValueError:
        return False
    for choice in payload.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


async def open_loop(
    url: str,
    model: str,
    phases: Sequence[Phase],
    *,
    prompt_words: tuple[int, int] = (100, 400),
    max_tokens: int = 48,
    seed: int = 0,
    headers: Mapping[str, str] | None = None,
) -> list[Result]:
    """Run ``phases`` back to back; every request's ``Result`` (in send order)."""
    rng = random.Random(seed)
    results: list[Result] = []
    tasks: set[asyncio.Task[Result]] = set()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for phase in phases:
            end = time.monotonic() + phase.duration_s
            next_at = time.monotonic()
            while True:
                next_at += rng.expovariate(phase.rate_per_s)
                if next_at >= end:
                    break
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                body = chat_body(model, rng.randint(*prompt_words), max_tokens, rng)
                result = Result(phase.name, time.monotonic())
                results.append(result)
                task = asyncio.create_task(send(session, url, body, result, headers))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.sleep(max(0.0, end - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=120)
    return results


async def closed_loop_throughput(
    url: str,
    model: str,
    *,
    concurrency: int,
    duration_s: float,
    prompt_words: tuple[int, int] = (100, 400),
    max_tokens: int = 48,
    seed: int = 1,
) -> float:
    """Completed requests per second with ``concurrency`` clients back to back (a replica's
    capacity when ``concurrency`` is its ``max_num_seqs`` and ``url`` the replica itself)."""
    rng = random.Random(seed)
    done: list[float] = []
    end = time.monotonic() + duration_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client() -> None:
            while time.monotonic() < end:
                body = chat_body(model, rng.randint(*prompt_words), max_tokens, rng)
                result = await send(session, url, body, Result("capacity", time.monotonic()))
                if result.status == 200 and result.done_at is not None and result.done_at <= end:
                    done.append(result.done_at)

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return len(done) / (end - start)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values`` (NaN when empty)."""
    if not values:
        return math.nan
    return float(np.quantile(np.asarray(values, dtype=float), q))
