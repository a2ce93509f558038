"""Live prediction accuracy: the real gateway's forecast headers against what each request measured.

The gateway forecasts every request on the replica it picked and says so in response headers
(``x-sluice-predicted-ttft-ms``, ``x-sluice-predicted-tpot-ms``, ``x-sluice-prediction``). This
module drives streaming load through a gateway and pairs each request's forecast with its outcome:

* **client TTFT**: request sent -> first content-carrying SSE event received by the client (so it
  includes the gateway's own work and two loopback hops, ~1-2 ms);
* **gateway TTFT**: the gateway's dispatch to the replica -> first token back at the gateway
  (``RequestOutcome.ttft_s``), when the gateway runs in this process (``serve_gateway``);
* **TPOT**: (last content event - first content event) / (completion tokens - 1), at the client.

Errors (``error_stats``): absolute percentage error per request, its median and 90th percentile,
the same quantiles of the absolute error in seconds, and the median of predicted / observed.
The targets: TTFT median <= 15 %, p90 <= 35 %; TPOT median <= 10 %, p90 <= 25 %, judged by
percentage alone (``ErrorStats.met``).

``python -m bench.live_accuracy`` is the benchmark: it runs the emulator scenarios of
``bench.live_runs`` at full size and prints each engine's errors against the targets. The library
part is used by ``tests/integration`` (behaviour checks on the emulator, small runs),
``tests/e2e/test_prediction_real_vllm.py`` and ``bench/predictor_accuracy_vllm.py`` (real vLLM on
CPU). No assertion here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import aiohttp
import numpy as np
from aiohttp import web

from gateway.api.responses import carries_tokens
from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.prediction.live import (
    PREDICTED_TPOT_HEADER,
    PREDICTED_TTFT_HEADER,
    PREDICTION_HEADER,
    REPLICA_HEADER,
)

#: (median, p90) absolute-percentage-error targets per latency, as fractions.
TARGETS: Mapping[str, tuple[float, float]] = {"ttft": (0.15, 0.35), "tpot": (0.10, 0.25)}

#: Words prompts are made of (any text would do: only its length matters).
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired")


@dataclass(frozen=True, slots=True)
class Sample:
    """One streamed request: what was forecast for it and what it measured (seconds, monotonic).

    ``prediction``: the ``x-sluice-prediction`` value (``ok`` or a reason); predicted values are
    ``None`` when the header was absent. Observed values are ``None`` when the stream produced too
    little to measure them (no token; fewer than two tokens for TPOT).
    """

    request_id: str
    sent_at: float
    prompt_chars: int
    max_tokens: int
    status: int
    replica: str | None
    prediction: str | None
    predicted_ttft_s: float | None
    predicted_tpot_s: float | None
    client_ttft_s: float | None
    client_tpot_s: float | None
    completion_tokens: int | None
    gateway_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """Streaming requests with prompt lengths (characters) and output caps (tokens) drawn uniformly
    from the given inclusive ranges; ``ignore_eos`` makes every answer exactly ``max_tokens`` long."""

    model: str
    prompt_chars: tuple[int, int] = (200, 3000)
    max_tokens: tuple[int, int] = (32, 128)
    ignore_eos: bool = True

    def draw(self, rng: random.Random) -> tuple[str, int]:
        """A prompt text and a ``max_tokens``."""
        chars = rng.randint(*self.prompt_chars)
        words: list[str] = []
        length = 0
        while length < chars:
            word = rng.choice(_WORDS)
            words.append(word)
            length += len(word) + 1
        return " ".join(words)[:chars], rng.randint(*self.max_tokens)


def _header_s(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        return float(value) / 1000.0
    except ValueError:
        return None


async def stream_one(
    session: aiohttp.ClientSession, base_url: str, workload: Workload, prompt: str, max_tokens: int
) -> Sample:
    """Send one streaming chat completion through the gateway at ``base_url`` and measure it."""
    request_id = uuid.uuid4().hex
    body = {
        "model": workload.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": workload.ignore_eos,
    }
    first: float | None = None
    last: float | None = None
    events = 0
    completion: int | None = None
    sent = time.monotonic()
    async with session.post(
        base_url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
    ) as resp:
        headers = resp.headers
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            payload = json.loads(line[6:])
            if carries_tokens(payload):
                first = now if first is None else first
                last = now
                events += 1
            usage = payload.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                completion = usage["completion_tokens"]
        status = resp.status
    tokens = completion if completion is not None else events
    return sample_from(
        request_id,
        sent,
        prompt,
        max_tokens,
        status,
        headers,
        first,
        last,
        tokens,
        completion_tokens=completion,
    )


def sample_from(
    request_id: str,
    sent: float,
    prompt: str,
    max_tokens: int,
    status: int,
    headers: Mapping[str, str],
    first: float | None,
    last: float | None,
    tokens: int,
    *,
    completion_tokens: int | None,
) -> Sample:
    """A ``Sample`` from one answer: its Sluice headers, and its first and last token times
    (monotonic seconds, ``None``: no token came) over ``tokens`` tokens (TPOT needs two)."""
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens >= 2 else None
    return Sample(
        request_id=request_id,
        sent_at=sent,
        prompt_chars=len(prompt),
        max_tokens=max_tokens,
        status=status,
        replica=headers.get(REPLICA_HEADER),
        prediction=headers.get(PREDICTION_HEADER),
        predicted_ttft_s=_header_s(headers, PREDICTED_TTFT_HEADER),
        predicted_tpot_s=_header_s(headers, PREDICTED_TPOT_HEADER),
        client_ttft_s=None if first is None else first - sent,
        client_tpot_s=tpot,
        completion_tokens=completion_tokens,
    )


async def closed_loop(
    base_url: str,
    workload: Workload,
    *,
    concurrency: int,
    duration_s: float,
    think_s: float = 0.05,
    seed: int = 0,
    stop: Callable[[Sequence[Sample]], bool] | None = None,
) -> list[Sample]:
    """``concurrency`` clients, each sending its next request a random think time (exponential,
    mean ``think_s``) after the previous one ended, for ``duration_s`` seconds (``math.inf``: no
    time limit) or until ``stop`` of the samples so far is true, whichever comes first. Clients
    start staggered over the first mean think time, so arrivals do not come in bursts."""
    samples: list[Sample] = []
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:

        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            await asyncio.sleep(think_s * index / max(concurrency, 1))
            while time.monotonic() < deadline and not (stop is not None and stop(samples)):
                prompt, max_tokens = workload.draw(rng)
                samples.append(await stream_one(s, base_url, workload, prompt, max_tokens))
                await asyncio.sleep(rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0)

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return samples


def enough_measured(
    replicas: Sequence[str], *, warmup_s: float, wanted: int, max_requests: int
) -> Callable[[Sequence[Sample]], bool]:
    """A ``stop`` for a load that counts, not times: true once every replica in ``replicas`` has
    answered ``wanted`` requests that ``measured`` would keep, or once ``max_requests`` requests
    were sent after the warm-up (so a run where forecasts never come still ends, and its checks
    say why). Counted from the earliest sample seen so far, as ``measured`` does: that only moves
    earlier, so the count here never exceeds the final one."""

    def stop(samples: Sequence[Sample]) -> bool:
        if not samples:
            return False
        start = min(s.sent_at for s in samples) + warmup_s
        late = [s for s in samples if s.sent_at >= start]
        served = Counter(s.replica for s in late if s.status == 200 and s.prediction == "ok")
        return len(late) >= max_requests or all(served[r] >= wanted for r in replicas)

    return stop


async def open_loop(
    base_url: str, workload: Workload, *, rate_per_s: float, duration_s: float, seed: int = 0
) -> list[Sample]:
    """Poisson arrivals at ``rate_per_s`` requests per second for ``duration_s`` seconds; waits for
    every request to finish."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks: list[asyncio.Task[Sample]] = []
        deadline = time.monotonic() + duration_s
        while True:
            await asyncio.sleep(rng.expovariate(rate_per_s))
            if time.monotonic() >= deadline:
                break
            prompt, max_tokens = workload.draw(rng)
            tasks.append(asyncio.create_task(stream_one(s, base_url, workload, prompt, max_tokens)))
        return list(await asyncio.gather(*tasks))


# -- an in-process gateway ---------------------------------------------------------------------------


@dataclass
class LocalGateway:
    """A gateway served by this process's event loop; ``ttfts`` maps request ids to the gateway's
    own dispatch -> first token seconds, for every request that had a first token."""

    url: str
    app: web.Application
    ttfts: dict[str, float]

    def with_gateway_ttft(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with ``gateway_ttft_s`` filled in from the gateway's outcomes."""
        return [replace(s, gateway_ttft_s=self.ttfts.get(s.request_id)) for s in samples]


@contextlib.asynccontextmanager
async def serve_gateway(settings: Settings) -> AsyncIterator[LocalGateway]:
    """Run the real gateway (``build_app``, emulators not spawned) on a free 127.0.0.1 port."""
    app = build_app(SettingsStore(settings), spawn_emulators=False)
    ttfts: dict[str, float] = {}

    def record(outcome: RequestOutcome) -> None:
        if outcome.ttft_s is not None:
            ttfts[outcome.request_id] = outcome.ttft_s

    app[OUTCOME_LISTENERS].append(record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield LocalGateway(f"http://{host}:{port}", app, ttfts)
    finally:
        await runner.cleanup()


async def wait_until_ready(base_url: str, model: str, timeout_s: float = 60.0) -> None:
    """Poll the gateway's ``/v1/models`` until it lists ``model``; ``TimeoutError`` otherwise."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(base_url + "/v1/models") as resp:
                    if resp.status == 200 and model in [m["id"] for m in (await resp.json())["data"]]:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the gateway at {base_url} did not list {model!r} within {timeout_s} s")


# -- errors ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Errors of ``n`` (predicted, observed) pairs: absolute percentage error as a fraction, and
    absolute error in seconds, at the median and the 90th percentile; ``median_ratio`` is the
    median of predicted / observed (1.0: unbiased; NaN without pairs)."""

    n: int
    median_ape: float
    p90_ape: float
    median_abs_s: float
    p90_abs_s: float
    median_ratio: float = math.nan

    def met(self, median_target: float, p90_target: float) -> bool:
        """Both percentage quantiles within their targets (fractions, inclusive); never met without
        data (``n == 0`` or NaN quantiles). No absolute floor: the percentage already scales with
        the value measured, and a fixed number of milliseconds passed any error on a ~7 ms TPOT."""
        return self.n > 0 and self.median_ape <= median_target and self.p90_ape <= p90_target

    def verdict(self, median_target: float, p90_target: float) -> str:
        """``met``, ``NOT met`` or ``NOT met (no data)``, as the benchmarks print it."""
        if self.n == 0 or math.isnan(self.median_ape) or math.isnan(self.p90_ape):
            return "NOT met (no data)"
        return "met" if self.met(median_target, p90_target) else "NOT met"


def error_stats(pairs: Sequence[tuple[float, float]]) -> ErrorStats:
    """``ErrorStats`` of (predicted, observed) pairs; observed values must be > 0."""
    if not pairs:
        nan = math.nan
        return ErrorStats(0, nan, nan, nan, nan, nan)
    predicted = np.array([p for p, _ in pairs])
    observed = np.array([o for _, o in pairs])
    absolute = np.abs(predicted - observed)
    ape = absolute / observed
    return ErrorStats(
        n=len(pairs),
        median_ape=float(np.median(ape)),
        p90_ape=float(np.quantile(ape, 0.9)),
        median_abs_s=float(np.median(absolute)),
        p90_abs_s=float(np.quantile(absolute, 0.9)),
        median_ratio=float(np.median(predicted / observed)),
    )


def measured(samples: Sequence[Sample], *, warmup_s: float) -> list[Sample]:
    """Samples sent at least ``warmup_s`` after the first one, answered 200, forecast ``ok``."""
    if not samples:
        return []
    start = min(s.sent_at for s in samples) + warmup_s
    return [s for s in samples if s.sent_at >= start and s.status == 200 and s.prediction == "ok"]


def accuracy(samples: Sequence[Sample]) -> dict[str, ErrorStats]:
    """Errors of ``samples`` (already filtered, see ``measured``), by what was observed:

    ``ttft_client``, ``ttft_gateway`` (when the gateway's TTFTs are known) and ``tpot``.
    """
    ttft_client = [
        (s.predicted_ttft_s, s.client_ttft_s)
        for s in samples
        if s.predicted_ttft_s is not None and s.client_ttft_s is not None and s.client_ttft_s > 0
    ]
    ttft_gateway = [
        (s.predicted_ttft_s, s.gateway_ttft_s)
        for s in samples
        if s.predicted_ttft_s is not None and s.gateway_ttft_s is not None and s.gateway_ttft_s > 0
    ]
    tpot = [
        (s.predicted_tpot_s, s.client_tpot_s)
        for s in samples
        if s.predicted_tpot_s is not None and s.client_tpot_s is not None and s.client_tpot_s > 0
    ]
    return {
        "ttft_client": error_stats(ttft_client),
        "ttft_gateway": error_stats(ttft_gateway),
        "tpot": error_stats(tpot),
    }


def target_of(metric: str) -> tuple[float, float]:
    """The (median, p90) target for an ``accuracy`` key (``ttft_*`` -> TTFT's, ``tpot`` -> TPOT's)."""
    return TARGETS["ttft" if metric.startswith("ttft") else "tpot"]


def describe(stats: Mapping[str, ErrorStats]) -> str:
    """One line per metric: n, median and p90 APE (%) and absolute error (ms), the median of
    predicted / observed, and the verdict against the metric's target."""
    lines = []
    for metric, e in stats.items():
        median_target, p90_target = target_of(metric)
        lines.append(
            f"{metric:<13} n={e.n:<4} median {e.median_ape * 100:5.1f} % ({e.median_abs_s * 1000:6.2f} ms)"
            f"  p90 {e.p90_ape * 100:5.1f} % ({e.p90_abs_s * 1000:6.2f} ms)"
            f"  predicted/observed {e.median_ratio:5.2f}"
            f"  targets {median_target * 100:.0f}/{p90_target * 100:.0f} %: "
            f"{e.verdict(median_target, p90_target)}"
        )
    return "\n".join(lines)


def observed_summary(samples: Sequence[Sample]) -> str:
    """Median observed and predicted TTFT and TPOT in ms, for context next to the errors."""

    def med(values: Sequence[float | None]) -> float:
        kept = [v for v in values if v is not None]
        return float(np.median(kept)) * 1000 if kept else math.nan

    return (
        f"TTFT client {med([s.client_ttft_s for s in samples]):.1f} ms, "
        f"gateway {med([s.gateway_ttft_s for s in samples]):.1f} ms, "
        f"predicted {med([s.predicted_ttft_s for s in samples]):.1f} ms; "
        f"TPOT observed {med([s.client_tpot_s for s in samples]):.2f} ms, "
        f"predicted {med([s.predicted_tpot_s for s in samples]):.2f} ms"
    )


def _end_s(sample: Sample) -> float | None:
    """When ``sample``'s stream ended, as its client saw it (monotonic seconds), or ``None``."""
    if sample.client_ttft_s is None:
        return None
    decoded = max(0, (sample.completion_tokens or 1) - 1) * (sample.client_tpot_s or 0.0)
    return sample.sent_at + sample.client_ttft_s + decoded


def ttft_by_load(samples: Sequence[Sample], kept: Sequence[Sample]) -> str:
    """The gateway-measured TTFT of ``kept`` by how many of the run's other requests (``samples``)
    were in flight when each was sent: per count, the requests, the measured p10 / median / p90
    and the forecast's median (ms); then the error of the best forecast that knows only that
    count (each count's own measured median, fitted in-sample: no forecast keyed on the load
    the gateway sees can do better). A diagnostic of what a replica's TTFT depends on."""
    ends = {s.request_id: _end_s(s) for s in samples}
    rows: dict[int, list[tuple[float, float]]] = {}
    for sample in kept:
        if sample.gateway_ttft_s is None or sample.predicted_ttft_s is None:
            continue
        at = sample.sent_at
        busy = sum(
            1
            for other in samples
            if other.request_id != sample.request_id
            and other.sent_at < at
            and (end := ends[other.request_id]) is not None
            and end > at
        )
        rows.setdefault(busy, []).append((sample.gateway_ttft_s, sample.predicted_ttft_s))
    if not rows:
        return "TTFT by requests in flight: no samples"
    lines = [
        "TTFT by other requests in flight at dispatch (ms): n, measured p10 / median / p90, forecast median"
    ]
    pairs: list[tuple[float, float]] = []
    for busy in sorted(rows):
        measured_s = np.array([m for m, _ in rows[busy]])
        forecast_s = np.array([f for _, f in rows[busy]])
        p10, p50, p90 = np.percentile(measured_s * 1e3, [10, 50, 90])
        lines.append(
            f"  {busy:2d} in flight: n={len(measured_s):4d}  {p10:7.1f} / {p50:7.1f} / {p90:7.1f}"
            f"  forecast {float(np.median(forecast_s)) * 1e3:7.1f}"
        )
        pairs.extend((float(np.median(measured_s)), float(m)) for m in measured_s)
    best = error_stats(pairs)
    lines.append(
        f"  best forecast from the count alone (in-sample medians): median {best.median_ape * 100:.1f} %, "
        f"p90 {best.p90_ape * 100:.1f} %"
    )
    return "\n".join(lines)


# -- the benchmark ------------------------------------------------------------------------------------

TABLE_HEADER = (
    "| scenario | engine | metric | n | median APE | p90 APE | predicted/observed | targets | verdict |\n"
    "|---|---|---|---:|---:|---:|---:|---|---|"
)


def table_rows(scenario: str, errors: Mapping[str, Mapping[str, ErrorStats]]) -> list[str]:
    """Markdown rows of ``TABLE_HEADER``: per engine (``errors``' keys) and metric, n, the median
    and p90 APE (with their absolute errors), the median ratio and the verdict."""
    rows = []
    for engine, by_metric in errors.items():
        for metric, e in by_metric.items():
            median_target, p90_target = target_of(metric)
            verdict = e.verdict(median_target, p90_target)
            rows.append(
                f"| {scenario} | {engine} | {metric} | {e.n} "
                f"| {e.median_ape * 100:.1f} % ({e.median_abs_s * 1000:.2f} ms) "
                f"| {e.p90_ape * 100:.1f} % ({e.p90_abs_s * 1000:.2f} ms) | {e.median_ratio:.2f} "
                f"| {median_target * 100:.0f} / {p90_target * 100:.0f} % | {verdict} |"
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the live scenarios at full size and print each engine's errors against ``TARGETS``.
    Exit status 0 whatever the verdicts: a benchmark reports, it does not gate."""
    # Imported here: bench.live_runs drives load with this module's helpers.
    from bench.live_runs import FleetLoad, fleet_run, single_run

    parser = argparse.ArgumentParser(
        prog="python -m bench.live_accuracy",
        description=(
            "Live forecast accuracy of the real gateway on the replica emulator, against the targets: "
            "TTFT median <= 15 %, p90 <= 35 %; TPOT median <= 10 %, p90 <= 25 %."
        ),
    )
    parser.add_argument("--scenario", choices=("single", "fleet", "both"), default="both")
    parser.add_argument("--single-clients", type=int, default=8, help="closed-loop streams on one vLLM")
    parser.add_argument("--single-load-s", type=float, default=22.0, help="seconds of load, warm-up included")
    parser.add_argument("--single-warmup-s", type=float, default=6.0)
    parser.add_argument("--fleet-openai-clients", type=int, default=6)
    parser.add_argument("--fleet-tgi-clients", type=int, default=2)
    parser.add_argument("--fleet-warmup-s", type=float, default=16.0)
    parser.add_argument("--fleet-load-s", type=float, default=40.0, help="measured seconds at least")
    parser.add_argument(
        "--fleet-samples", type=int, default=100, help="measured requests per engine at least"
    )
    args = parser.parse_args(argv)

    rows: list[str] = []
    if args.scenario in ("single", "both"):
        single = single_run(
            concurrency=args.single_clients, warmup_s=args.single_warmup_s, load_s=args.single_load_s
        )
        print(f"single vLLM: {len(single.samples)} requests, {len(single.kept)} measured", flush=True)
        print(describe(single.errors))
        print(observed_summary(single.kept))
        print(ttft_by_load(single.samples, single.kept), flush=True)
        rows += table_rows("single", {"vllm": single.errors})
    if args.scenario in ("fleet", "both"):
        load = FleetLoad(
            openai_clients=args.fleet_openai_clients,
            tgi_clients=args.fleet_tgi_clients,
            warmup_s=args.fleet_warmup_s,
            wanted=args.fleet_samples,
            min_load_s=args.fleet_load_s,
        )
        fleet = fleet_run(load)
        print(f"fleet: {len(fleet.samples)} requests", flush=True)
        for engine, kept in fleet.kept.items():
            native = sum(1 for s in kept if fleet.route[s.request_id] == "tgi_native")
            print(f"{engine}: {len(kept)} measured ({native} TGI-native); {observed_summary(kept)}")
        print(f"TGI decode steps ran {fleet.tgi_decode_overhead_s * 1000:.2f} ms beyond their forward pass")
        rows += table_rows("fleet", fleet.errors)
    print()
    print(TABLE_HEADER)
    print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
