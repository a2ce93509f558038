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

``python -m bench.admission_load --spike`` runs the spike scenario and reports its
targets: ``sluice serve`` (own process) in front of one emulated replica that takes 4 sequences
at a time (own process); capacity measured first (4 clients straight at the replica), then
open-loop streaming load: a warm-up at 0.3x capacity, three times capacity for ``SPIKE_S``
seconds, and 0.3x again. Targets: admitted requests' client TTFT p90 <= 0.6 s and TPOT p90 <=
25 ms (TTFT p99 within 1.25x the target: nothing sent that could not meet it), 429s answered
with p99 <= 100 ms, and no refusal from 5 s after the spike's end. The live test
(``tests/integration/admission/test_spike.py``) runs the same scenario for behaviour only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from gateway.admission.config import INTERACTIVE_STALL_BUDGET_HORIZON

__all__ = [
    "SPIKE_ADMISSION",
    "Phase",
    "Result",
    "SpikeRun",
    "chat_body",
    "closed_loop_throughput",
    "open_loop",
    "quantile",
    "run_spike",
    "send",
    "spike_summary",
    "spike_targets",
    "verdict_text",
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


#: The spike's normal load, as a fraction of capacity. With 4 decode slots and long outputs a slot
#: is free for a new request within the TTFT target almost always at this load (Erlang C, 4
#: servers at 30 % utilisation: about 3 % of arrivals wait at all); at 0.5x about 17 % would
#: wait and Sluice truthfully refuses the few whose wait would break the target, spike or not.
SPIKE_NORMAL_LOAD = 0.3
#: The spike's load, as a multiple of capacity.
SPIKE_LOAD = 3.0
SPIKE_TTFT_TARGET_S = 0.6
SPIKE_TPOT_TARGET_S = 0.025
SPIKE_WARMUP_S = 6.0
SPIKE_S = 25.0
SPIKE_NORMAL_S = 12.0
#: Target: no refusal among requests sent this long after the spike's end (seconds).
SPIKE_RECOVERY_S = 5.0
#: Target: a refusal is answered within this at the 99th percentile (at the client).
SPIKE_REJECT_P99_S = 0.1
#: Target: the p99 of admitted TTFT within this multiple of the TTFT target.
SPIKE_TTFT_P99_TOLERANCE = 1.25
#: The spike's admission section: one interactive class that queues for up to 0.4 s.
SPIKE_ADMISSION: dict[str, object] = {
    "classes": {
        "interactive": {
            "ttft_target_s": SPIKE_TTFT_TARGET_S,
            "tpot_target_s": SPIKE_TPOT_TARGET_S,
            "max_queue_wait_s": 0.4,
            "queue_capacity": 64,
            # The built-in interactive class's per-stream stall budget (a class map given in the
            # configuration replaces the built-in classes, so it is set here as shipped).
            "stall_budget_horizon": INTERACTIVE_STALL_BUDGET_HORIZON,
        },
    },
    "default_class": "interactive",
}


@dataclass
class SpikeRun:
    """One run of the spike: the replica's capacity (req/s), every request in send order, the
    last spike request's ``sent_at`` (``time.monotonic`` seconds) and the processes' log tails."""

    capacity_per_s: float
    results: list[Result]
    spike_end: float
    logs: dict[str, str] = field(default_factory=dict)


def run_spike(workdir: Path, *, seed: int = 7) -> SpikeRun:
    """Start an emulated 4-slot replica and ``sluice serve`` in front of it (config written under
    ``workdir``), run the spike's phases through the gateway, stop both and return the run."""
    from tests.integration.admission.conftest import (
        MODEL,
        Running,
        gateway_config,
        start_emulator,
        start_gateway,
    )

    emulator = start_emulator()
    gateway: Running | None = None
    logs: dict[str, str] = {}
    try:
        capacity = asyncio.run(closed_loop_throughput(emulator.url, MODEL, concurrency=4, duration_s=5.0))
        gateway = start_gateway(workdir, gateway_config(emulator.url, SPIKE_ADMISSION))
        phases = [
            Phase("warmup", SPIKE_NORMAL_LOAD * capacity, SPIKE_WARMUP_S),
            Phase("spike", SPIKE_LOAD * capacity, SPIKE_S),
            Phase("normal", SPIKE_NORMAL_LOAD * capacity, SPIKE_NORMAL_S),
        ]
        results = asyncio.run(open_loop(gateway.url, MODEL, phases, seed=seed))
    finally:
        for r in (gateway, emulator):
            if r is not None:
                r.proc.stop()
                logs[r.proc.name] = r.proc.output()[-3000:]
    spike_sent = [r.sent_at for r in results if r.phase == "spike"]
    return SpikeRun(capacity, results, max(spike_sent, default=math.nan), logs)


def spike_summary(run: SpikeRun) -> str:
    """Per phase: sent, admitted, refused, client TTFT/TPOT quantiles, 429 answer times; the
    spike's TTFT forecast error and the refusals by reason."""
    lines = [f"capacity {run.capacity_per_s:.1f} req/s (4 clients straight at the replica)"]
    for phase in ("warmup", "spike", "normal"):
        rs = [r for r in run.results if r.phase == phase]
        ok = [r for r in rs if r.status == 200]
        rejected = [r for r in rs if r.status == 429]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
        answer = [r.answer_s for r in rejected if r.answer_s is not None]
        lines.append(
            f"{phase:7s} sent {len(rs):4d} admitted {len(ok):4d} rejected {len(rejected):4d} "
            f"other {len(rs) - len(ok) - len(rejected):3d} | TTFT p50 {quantile(ttft, 0.5) * 1e3:6.1f} "
            f"p90 {quantile(ttft, 0.9) * 1e3:6.1f} p99 {quantile(ttft, 0.99) * 1e3:6.1f} max "
            f"{max(ttft, default=math.nan) * 1e3:6.1f} ms | TPOT p90 {quantile(tpot, 0.9) * 1e3:5.1f} ms "
            f"| 429 p50 {quantile(answer, 0.5) * 1e3:5.1f} p99 {quantile(answer, 0.99) * 1e3:5.1f} ms"
        )
    errors = [
        r.ttft_s / (float(r.headers["x-sluice-predicted-ttft-ms"]) / 1e3) - 1.0
        for r in run.results
        if r.status == 200
        and r.ttft_s is not None
        and r.headers.get("x-sluice-predicted-ttft-ms")
        and r.phase == "spike"
    ]
    lines.append(
        "spike: client TTFT / predicted - 1: "
        + " ".join(f"p{int(q * 100)} {quantile(errors, q):+.2f}" for q in (0.1, 0.5, 0.9, 0.99))
    )
    reasons: dict[str, int] = {}
    for r in run.results:
        if r.status != 200:
            key = f"{r.status}:{r.headers.get('x-sluice-admission-reason', r.error)}"
            reasons[key] = reasons.get(key, 0) + 1
    lines.append(f"not admitted by reason: {reasons}")
    return "\n".join(lines)


def spike_targets(run: SpikeRun) -> list[tuple[str, str, bool | None]]:
    """The spike's targets: (target, measured, met). ``met`` is None where there is no data to
    judge (reported as "not met (no data)", never as met)."""
    admitted = [r for r in run.results if r.phase != "warmup" and r.status == 200]
    ttft = [r.ttft_s for r in admitted if r.ttft_s is not None]
    tpot = [r.tpot_s for r in admitted if r.tpot_s is not None]
    answers = [r.answer_s for r in run.results if r.status == 429 and r.answer_s is not None]
    after = [r for r in run.results if r.phase == "normal" and r.sent_at >= run.spike_end + SPIKE_RECOVERY_S]
    refused_after = sum(r.status != 200 for r in after)
    ttft_p99_s = SPIKE_TTFT_TARGET_S * SPIKE_TTFT_P99_TOLERANCE
    return [
        _verdict(f"admitted TTFT p90 <= {SPIKE_TTFT_TARGET_S * 1e3:.0f} ms", ttft, 0.9, SPIKE_TTFT_TARGET_S),
        _verdict(f"admitted TPOT p90 <= {SPIKE_TPOT_TARGET_S * 1e3:.0f} ms", tpot, 0.9, SPIKE_TPOT_TARGET_S),
        _verdict(f"admitted TTFT p99 <= {ttft_p99_s * 1e3:.0f} ms", ttft, 0.99, ttft_p99_s),
        _verdict(f"429 answered p99 <= {SPIKE_REJECT_P99_S * 1e3:.0f} ms", answers, 0.99, SPIKE_REJECT_P99_S),
        (
            f"no refusal from {SPIKE_RECOVERY_S:g} s after the spike",
            f"{refused_after} of {len(after)} refused" if after else "no data",
            (refused_after == 0) if after else None,
        ),
    ]


def _verdict(name: str, values: Sequence[float], q: float, bound_s: float) -> tuple[str, str, bool | None]:
    if not values:
        return (name, "no data", None)
    value = quantile(values, q)
    return (name, f"{value * 1e3:.1f} ms", value <= bound_s)


def verdict_text(met: bool | None) -> str:
    """How a target's ``met`` reads: met, NOT MET, or not met (no data) for None."""
    return "not met (no data)" if met is None else ("met" if met else "NOT MET")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spike", action="store_true", help="run the spike and report its targets")
    parser.add_argument("--seed", type=int, default=7, help="arrival and prompt seed")
    args = parser.parse_args(argv)
    if not args.spike:
        parser.error("nothing to run: give --spike")
    with tempfile.TemporaryDirectory(prefix="sluice-spike-") as tmp:
        run = run_spike(Path(tmp), seed=args.seed)
    print(spike_summary(run))
    targets = spike_targets(run)
    for name, measured, met in targets:
        print(f"- {name}: {measured} -> {verdict_text(met)}")
    sys.exit(0 if all(met for _, _, met in targets) else 1)


if __name__ == "__main__":
    main()
