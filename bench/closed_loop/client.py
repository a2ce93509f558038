"""The closed-loop bench's client: streamed chat completions sent open-loop, each one measured.

It knows only the OpenAI API and Sluice's documented response headers (``x-sluice-admission``,
``x-sluice-admission-reason``, ``x-sluice-predicted-ttft-ms``, ``x-sluice-predicted-tpot-ms``,
``Retry-After``), and sends the same requests straight to vLLM or through Sluice. Times are the
client's: TTFT from sending the request to the first event that carries output, TPOT the mean
gap after it over the output tokens vLLM reports (``stream_options.include_usage``). Every
answer asks for exactly its output size (``max_tokens`` with ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from bench.closed_loop.workload import Arrival, prompt_text
from gateway.api.responses import carries_tokens
from replay import Targets

__all__ = ["Outcome", "chars_per_token", "get_json", "replay", "saturate"]

#: Characters of the sample text whose token count gives ``chars_per_token``.
_SAMPLE_TOKENS = 4000


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it. Seconds; ``None``: not seen.

    ``sent_s``: when it was sent, from the point's start. ``prompt_tokens`` / ``output_tokens``:
    its sizes in the scaled trace (what it asked for). ``status``: the HTTP status, ``None`` when
    no answer came before the point ended (it was then cancelled). ``tokens``: output tokens
    received (vLLM's usage when it came, else the events that carried output). ``finished``: the
    stream ended with ``[DONE]``. ``admission``, ``admission_reason`` and ``predicted_*``:
    Sluice's headers (``None`` on the direct path; the reason is ``ok`` or what refused it, for
    example ``ttft`` or ``deadline_exceeded``). ``retry_after_s``: a refusal's ``Retry-After``.
    """

    index: int
    sent_s: float
    prompt_tokens: int
    output_tokens: int
    status: int | None
    ttft_s: float | None
    tpot_s: float | None
    tokens: int
    finished: bool
    admission: str | None = None
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    retry_after_s: float | None = None
    admission_reason: str | None = None

    def met(self, targets: Targets) -> bool:
        """Answered 200, streamed to its end, first token within the TTFT target and a mean TPOT
        within the TPOT target (a one-token answer has no TPOT to miss)."""
        if self.status != 200 or not self.finished or self.ttft_s is None or self.tokens < 1:
            return False
        return self.ttft_s <= targets.ttft_s and (self.tpot_s is None or self.tpot_s <= targets.tpot_s)


@dataclass(slots=True)
class _Progress:
    """What one request has seen so far (filled while it streams; read when cancelled)."""

    sent: float = 0.0
    status: int | None = None
    headers: Mapping[str, str] | None = None
    first: float | None = None
    last: float | None = None
    events: int = 0
    usage_tokens: int | None = None
    finished: bool = False


def _header_s(headers: Mapping[str, str] | None, name: str, scale: float) -> float | None:
    value = None if headers is None else headers.get(name)
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        return float(value) * scale
    return None


def _outcome(arrival: Arrival, p: _Progress, start: float) -> Outcome:
    tokens = p.usage_tokens if p.usage_tokens is not None else p.events
    tpot = None
    if p.first is not None and p.last is not None and tokens >= 2:
        tpot = (p.last - p.first) / (tokens - 1)
    h = p.headers
    return Outcome(
        index=arrival.index,
        sent_s=p.sent - start,
        prompt_tokens=arrival.prompt_tokens,
        output_tokens=arrival.output_tokens,
        status=p.status,
        ttft_s=None if p.first is None else p.first - p.sent,
        tpot_s=tpot,
        tokens=tokens,
        finished=p.finished,
        admission=None if h is None else h.get("x-sluice-admission"),
        predicted_ttft_s=_header_s(h, "x-sluice-predicted-ttft-ms", 1e-3),
        predicted_tpot_s=_header_s(h, "x-sluice-predicted-tpot-ms", 1e-3),
        retry_after_s=_header_s(h, "retry-after", 1.0),
        admission_reason=None if h is None else h.get("x-sluice-admission-reason"),
    )


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, object],
    headers: Mapping[str, str],
    p: _Progress,
) -> None:
    """POST ``body`` to ``url`` as a stream, recording into ``p`` as events arrive."""
    p.sent = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        p.status, p.headers = resp.status, resp.headers
        if resp.status != 200:
            await resp.read()
            return
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                p.finished = True
                break
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            payload = json.loads(line[6:])
            if carries_tokens(payload):
                p.first = now if p.first is None else p.first
                p.last = now
                p.events += 1
            usage = payload.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                p.usage_tokens = usage["completion_tokens"]


def _body(model: str, arrival: Arrival, chars_per_token: float, salt: int) -> dict[str, object]:
    text = prompt_text(arrival.prompt_tokens, chars_per_token, salt * 1_000_000 + arrival.index)
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": arrival.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )


async def replay(
    url: str,
    arrivals: Sequence[Arrival],
    *,
    model: str,
    chars_per_token: float,
    grace_s: float,
    api_key: str | None = None,
    salt: int = 0,
) -> list[Outcome]:
    """Send each of ``arrivals`` at its time (open loop: whatever the answers) to ``url`` (vLLM or
    Sluice, no ``/v1``) and measure it; ``grace_s`` seconds after the last arrival, whatever is
    still unanswered or streaming is cancelled and reported as it stood. ``salt``: seeds the
    prompts' texts with the arrivals' indices (another salt: texts that share no prefix)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    progress = [_Progress() for _ in arrivals]
    async with _session() as session:
        start = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        for arrival, p in zip(arrivals, progress, strict=True):
            delay = start + arrival.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            body = _body(model, arrival, chars_per_token, salt)
            tasks.append(asyncio.create_task(_stream(session, url, body, headers, p)))
        last = arrivals[-1].at_s if arrivals else 0.0
        remaining = max(0.0, start + last + grace_s - time.monotonic())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for p, result in zip(progress, results, strict=True):
                if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
                    p.status = p.status or 0  # a transport error: answered with nothing usable
    return [_outcome(a, p, start) for a, p in zip(arrivals, progress, strict=True)]


async def saturate(
    url: str,
    arrivals: Sequence[Arrival],
    *,
    model: str,
    chars_per_token: float,
    concurrency: int,
    duration_s: float,
    salt: int = 0,
) -> int:
    """Requests completed within ``duration_s`` by ``concurrency`` clients sending ``arrivals``'
    requests (in order, over again when they run out) back to back; what is still running then is
    cancelled. Completed / ``duration_s`` is the engine's capacity for this mix."""
    if not arrivals:
        raise ValueError("no requests to saturate with")
    source = itertools.cycle(arrivals)
    done = 0
    deadline = time.monotonic() + duration_s

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            p = _Progress()
            await _stream(session, url, _body(model, next(source), chars_per_token, salt), {}, p)
            if p.finished and time.monotonic() <= deadline:
                done += 1

    async with _session() as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.wait(workers, timeout=duration_s)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return done


async def chars_per_token(vllm_url: str, model: str) -> float:
    """Characters per token of ``prompt_text``'s text for ``model``'s tokenizer, by vLLM's
    ``POST /tokenize`` of a sample."""
    text = prompt_text(_SAMPLE_TOKENS, 4.0, seed=1)
    async with (
        _session() as session,
        session.post(
            vllm_url + "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}
        ) as resp,
    ):
        resp.raise_for_status()
        count = int((await resp.json())["count"])
    if count <= 0:
        raise ValueError(f"vLLM counted {count} tokens in {len(text)} characters")
    return len(text) / count


async def get_json(url: str) -> object:
    """``GET url``'s JSON body (raises on a non-2xx answer)."""
    async with _session() as session, session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()
