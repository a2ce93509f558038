"""A mixed fleet behind one gateway: one emulated vLLM, one TGI, one SGLang (issue 8, point 4).

Three emulator processes (``python -m simulator --engine vllm|tgi|sglang``, one profile, so they
serve the same model) sit behind the real gateway (``build_app`` on a free port, in this process),
each declared with its engine and what an operator knows (an H100-SXM serving Llama-3-8B). Two
kinds of client drive a steady closed loop for ``WARMUP_S`` seconds of warm-up, then ``LOAD_S``
seconds, on until every engine has answered ``MIN_SAMPLES`` measured requests (``MAX_LOAD_S`` at
most):

* ``OPENAI_CLIENTS`` clients stream chat completions with the real ``openai`` SDK (routed anywhere
  in the fleet; prompts of 600-5000 characters, 32-128 output tokens, ``ignore_eos``);
* ``TGI_CLIENTS`` clients stream TGI's native ``POST /generate_stream`` (only the TGI replica
  serves it; its output ends at the emulator's sampled length, up to ``max_new_tokens``).

The load is moderate and steady: eight closed-loop clients, two or three streams per replica, so
each engine's batch holds a few sequences (the emulated H100 takes up to 1024; its step time at
batch 4 is within a few percent of batch 1). The gateway routes them by slack, and
replicas whose slacks are within 1 % of the target of the most go by the fewest of the gateway's
requests (``gateway.admission.decision._SLACK_TIE``): under the clients' loose targets
(``ADMISSION``) the engines' forecasts differ by milliseconds, far less, so the load spreads by
the gateway's count. (Ranked on those milliseconds alone, the engine whose fit was a little slower
got next to nothing: SGLang ~5 % by TPOT slack; by TTFT slack, vLLM once 3 of 754, its fit stuck
at 2 observations, since only traffic corrects a fit.) The host, not the engines, is what such a
run fills: on a quiet 2-core box twelve clients made it relay about 1500 SSE events a second; on
the shared one, with other suites running, requests take several times their nominal time. The
clients run in their own process (``drive``) so that the SDK's per-chunk work does not slow the
gateway's loop they measure. Requests sent in the first ``WARMUP_S`` seconds are left out: the
fits need a few scrapes.

Each request's ``x-sluice-predicted-ttft-ms`` / ``-tpot-ms`` headers are compared, per engine,
with what it measured: TTFT as the gateway measured it (dispatch to first token back: the engine
forecast plus the replica's learned dispatch overhead, the HTTP hop and the server's own work),
TPOT at the client. The admission's ``forecast_margin`` is 0 here, so the headers carry the
predictor's forecast, not admission's 15 % safety margin on it, against issue 3's targets
(``bench.live_accuracy.TARGETS``), on every engine, in the default run (docs/engines.md, "On a
busy host", has the runs: TTFT p90 at most 26.1 % against 35 % in 6 quiet runs on a 2-core box,
at most 34.0 % with two to four busy loops beside it; one run in 11 missed on TGI's fit at batch
8, before TGI's fit stopped learning from TTFTs, and none of 10 since). The same run checks that
TGI's fitted step model (from its measured forward durations alone) matches the emulator's
cost model, and that TGI's context length came from its ``/info``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.live_accuracy import (
    TARGETS,
    ErrorStats,
    Sample,
    Workload,
    describe,
    error_stats,
    measured,
    serve_gateway,
    wait_until_ready,
)
from gateway.admission.config import AdmissionSettings, ClassSettings
from gateway.forecasts import PREDICTED_TPOT_HEADER, PREDICTED_TTFT_HEADER, PREDICTION_HEADER, REPLICA_HEADER
from gateway.keys import PREDICTION_SERVICE, REGISTRY
from gateway.prediction import PredictionService
from gateway.replicas.registry import ReplicaState
from gateway.settings import (
    HardwareSettings,
    HealthSettings,
    LoggingSettings,
    ReplicaSettings,
    ServerSettings,
    Settings,
)
from predictor import StepBatch
from simulator.costmodel import CostModel, StepShape
from simulator.profile import load_profile
from tests.support.procs import Proc, free_port, python_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

PROFILE = "llama3-8b-h100"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the profile's served_model_name
MAX_MODEL_LEN = 8192  # the profile's
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
ENGINES = ("vllm", "tgi", "sglang")
#: Eight clients, not twelve: the three emulators, the gateway and the clients' process share the
#: host's cores, and with twelve a starved host (everything on one core beside a busy loop) had
#: vLLM's and SGLang's first tokens come a median 4 ms (15-21 %) later than forecast, TTFT p90 up
#: to 38.8 % (one run in four failed; the landing CI of 133d848 failed at 36.7 and 41.5 %). With
#: eight, such runs were unbiased (median error within 0.2 ms in the one traced), TTFT p90 at most
#: 29.9 % in 7 runs, 29.1 % with two busy loops (docs/engines.md, "A starved host").
OPENAI_CLIENTS = 6
TGI_CLIENTS = 2
#: Requests sent before this are left out. The fits need a few scrapes, and the dispatch overhead
#: (an EWMA over 10 s scrape windows) about 20 s to forget the start: with two busy loops beside
#: the run it peaked at 9-10 ms on TGI 8-10 s in (start-up stalls, the first scrapes' full parses)
#: and settled near 4 ms by 25 s; measured from 8 s, TGI's first 10 s were over-forecast by a
#: median 26-40 % and its TTFT p90 missed 35 % (docs/engines.md, "On a busy host").
WARMUP_S = 16.0
#: Seconds of measured load at least; then until every engine answered ``MIN_SAMPLES`` requests
#: after the warm-up (the gateway routes by slack: an engine whose forecasts are a little slower
#: gets a smaller share), but never longer than ``MAX_LOAD_S``.
LOAD_S = 40.0
MAX_LOAD_S = 150.0
THINK_S = 0.05
#: Fewer measured requests per engine than this would make the quantiles meaningless.
MIN_SAMPLES = 100
#: Requests each engine must have served over the run, however slow the box (outcome check).
MIN_SERVED = 3
#: Prompts of 600-5000 characters are 120-1000 tokens (median ~550) to the emulator, nearer chat
#: prompts (the Azure 2023 conversation trace's median is 1020). With 200-3000 characters (40-600
#: tokens) a first token took ~18 ms, two or three steps of 7 ms, and a few milliseconds of the
#: host's scheduling on a busy box were a third of it: the TTFT p90 went from ~22 % on a quiet box
#: to 31-35 % with three CPU hogs beside it, and over 35 % twice in CI. Longer still (1000-8000
#: characters) held better under load, but drove TGI's fit astray until TTFTs stopped feeding it
#: (docs/engines.md, "On a busy host").
WORKLOAD = Workload(MODEL, prompt_chars=(600, 5000))
#: The clients' class. Its targets are loose enough that nothing is refused however slow the box
#: (a starved gateway loop once put a forecast first token 0.6 s after arrival); the engines'
#: slacks under them differ by far less than 1 % of a target, so they count as comparable and
#: requests go where the gateway has the fewest (``_SLACK_TIE``). No forecast margin: the headers
#: then carry the predictor's own forecast (admission's default 0.15 would add 15 %, by design).
ADMISSION = AdmissionSettings(
    forecast_margin=0.0,
    classes={"interactive": ClassSettings(ttft_target_s=5.0, tpot_target_s=50.0, max_queue_wait_s=30.0)},
)
ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Run:
    samples: list[Sample]
    #: Samples by the route they took: "openai" or "tgi_native".
    route: Mapping[str, str]
    #: Measured samples (after warm-up, 200, forecast ok) by the engine that served them.
    kept: Mapping[str, list[Sample]]
    #: Errors by engine, then by metric (``ttft`` at the gateway, ``tpot`` at the client).
    errors: Mapping[str, Mapping[str, ErrorStats]]
    service: PredictionService
    #: Mean seconds the TGI emulator's decode step cycles took beyond the cost model's forward.
    tgi_decode_overhead_s: float


def _header_s(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    return None if value is None else float(value) / 1000.0


def _sample(
    rid: str,
    sent: float,
    prompt: str,
    max_tokens: int,
    status: int,
    headers: Mapping[str, str],
    first: float | None,
    last: float | None,
    tokens: int,
) -> Sample:
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens >= 2 else None
    return Sample(
        request_id=rid,
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
        completion_tokens=tokens,
    )


async def _openai_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> Sample:
    """One streamed chat completion through the real SDK; its headers and token times."""
    rid = uuid.uuid4().hex
    sent = time.monotonic()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": rid},
    )
    first: float | None = None
    last: float | None = None
    events, usage = 0, None
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.monotonic()
            first = last if first is None else first
            events += 1
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return _sample(
        rid,
        sent,
        prompt,
        max_tokens,
        raw.http_response.status_code,
        raw.headers,
        first,
        last,
        usage if usage is not None else events,
    )


async def _tgi_one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> Sample:
    """One TGI-native ``/generate_stream``: one SSE event per token, the last with the text."""
    rid = uuid.uuid4().hex
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}
    first: float | None = None
    last: float | None = None
    events = 0
    sent = time.monotonic()
    async with session.post(url + "/generate_stream", json=body, headers={"x-request-id": rid}) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            payload = json.loads(line[6:])
            if isinstance(payload.get("token"), dict):
                last = time.monotonic()
                first = last if first is None else first
                events += 1
        return _sample(rid, sent, prompt, max_tokens, resp.status, resp.headers, first, last, events)


def _enough(samples: list[Sample], measured_from: float, wanted: int) -> bool:
    """Every engine answered ``wanted`` requests sent from ``measured_from`` on, forecast."""
    served = Counter(
        s.replica for s in samples if s.sent_at >= measured_from and s.status == 200 and s.prediction == "ok"
    )
    return all(served[e] >= wanted for e in ENGINES)


async def _load(url: str, wanted: int) -> tuple[list[Sample], dict[str, str]]:
    """The clients' closed loops for ``LOAD_S`` measured seconds and on until every engine has
    ``wanted`` measured requests (0: no more), ``MAX_LOAD_S`` at most."""
    samples: list[Sample] = []
    route: dict[str, str] = {}
    start = time.monotonic()
    # The test measures the requests sent WARMUP_S after the first one (sent at about ``start``):
    # counted from a second later, the two never disagree.
    measured_from, at_least, at_most = (
        start + WARMUP_S + 1.0,
        start + WARMUP_S + LOAD_S,
        start + WARMUP_S + MAX_LOAD_S,
    )
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    total = OPENAI_CLIENTS + TGI_CLIENTS
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def client(index: int) -> None:
            rng = random.Random(1000 + index)
            await asyncio.sleep(THINK_S * index / total)  # staggered: no burst at the start
            while (now := time.monotonic()) < at_most and (
                now < at_least or not _enough(samples, measured_from, wanted)
            ):
                prompt, max_tokens = WORKLOAD.draw(rng)
                if index < OPENAI_CLIENTS:
                    sample, kind = await _openai_one(sdk, prompt, max_tokens), "openai"
                else:
                    sample, kind = await _tgi_one(session, url, prompt, max_tokens), "tgi_native"
                samples.append(sample)
                route[sample.request_id] = kind
                await asyncio.sleep(rng.expovariate(1.0 / THINK_S))

        try:
            await asyncio.gather(*(client(i) for i in range(total)))
        finally:
            await sdk.close()
    return samples, route


def drive() -> None:
    """Entry point of the load process: ``drive URL OUT WANTED`` runs ``_load`` against the
    gateway at URL and writes the samples and their routes to OUT as JSON. The clients (the SDK's
    parsing above all) run in their own process so they do not slow the gateway's loop they
    measure."""
    url, out, wanted = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        samples, route = runner.run(_load(url, wanted))
    Path(out).write_text(json.dumps({"samples": [dataclasses.asdict(s) for s in samples], "route": route}))


async def _drive(url: str, out: Path, wanted: int) -> tuple[list[Sample], dict[str, str]]:
    code = "from tests.integration.gateway.test_mixed_fleet import drive; drive()"
    args = (url, str(out), str(wanted))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *args, cwd=ROOT)
    try:
        rc = await asyncio.wait_for(proc.wait(), WARMUP_S + MAX_LOAD_S + 120.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0, f"the load process failed ({rc})"
    data = json.loads(await asyncio.to_thread(out.read_text))
    return [Sample(**s) for s in data["samples"]], data["route"]


async def _measure(
    urls: Mapping[str, str], out: Path, wanted: int
) -> tuple[list[Sample], dict[str, str], PredictionService, float, dict[str, object]]:
    settings = Settings(
        server=ServerSettings(port=0),
        replicas=[
            ReplicaSettings(name="vllm", url=urls["vllm"], backend="vllm", hardware=HARDWARE),
            ReplicaSettings(name="tgi", url=urls["tgi"], backend="tgi", hardware=HARDWARE),
            ReplicaSettings(name="sglang", url=urls["sglang"], backend="sglang", hardware=HARDWARE),
        ],
        health=HealthSettings(interval_s=1.0, timeout_s=1.0),
        logging=LoggingSettings(access_log=False),
        admission=ADMISSION,
    )
    async with serve_gateway(settings) as gateway:
        await wait_until_ready(gateway.url, MODEL)
        registry = gateway.app[REGISTRY]
        for _ in range(300):  # every replica healthy, not only the first one
            if all(r.state == ReplicaState.HEALTHY for r in registry.replicas()):
                break
            await asyncio.sleep(0.1)
        at_start = {r.name: r.state.value for r in registry.replicas()}
        samples, route = await _drive(gateway.url, out, wanted)
        overhead = await _decode_overhead_s(urls["tgi"])
        service = gateway.app[PREDICTION_SERVICE]
        # What the gateway thought of each replica at the end (health, fit, last scrape): printed
        # when an engine was left without its share, so that such a run explains itself.
        state = {
            "health_at_start": at_start,
            "registry": registry.describe(),
            "prediction": service.describe()["replicas"],
        }
        return gateway.with_gateway_ttft(samples), route, service, overhead, state


async def _decode_overhead_s(url: str) -> float:
    """Mean seconds a TGI decode step's cycle (``tgi_batch_inference_duration``) took beyond its
    forward pass (``tgi_batch_forward_duration``, the cost model's time) over the whole run."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("method") == "decode" and sample.name.endswith(("_sum", "_count")):
                totals[sample.name] = sample.value
    count = totals["tgi_batch_forward_duration_count"]
    return (totals["tgi_batch_inference_duration_sum"] - totals["tgi_batch_forward_duration_sum"]) / count


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Three emulators, one gateway, one load run for every test of this module, on until every
    engine has ``MIN_SAMPLES`` measured requests (the error quantiles need them)."""
    procs: dict[str, Proc] = {}
    urls: dict[str, str] = {}
    try:
        for seed, engine in enumerate(ENGINES, start=1):
            port = free_port()
            args = python_module(
                "simulator",
                "--profile",
                PROFILE,
                "--port",
                str(port),
                "--seed",
                str(seed),
                "--jitter",
                "0.02",
                "--engine",
                engine,
            )
            procs[engine] = Proc(args, name=f"emulator-{engine}")
            urls[engine] = f"http://127.0.0.1:{port}"
        for engine, proc in procs.items():
            proc.wait_http(urls[engine] + "/health")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as `sluice serve` runs
            out = tmp_path_factory.mktemp("mixed") / "samples.json"
            samples, route, service, overhead, state = runner.run(_measure(urls, out, MIN_SAMPLES))
    finally:
        for proc in procs.values():
            proc.stop()
    good = measured(samples, warmup_s=WARMUP_S)
    kept = {e: [s for s in good if s.replica == e] for e in ENGINES}
    errors = {e: _errors(kept[e]) for e in ENGINES}
    print(f"\n{len(samples)} requests, {len(good)} measured after {WARMUP_S:g} s of warm-up")
    print(Counter((s.replica, route[s.request_id], s.prediction, s.status) for s in samples))
    for engine in ENGINES:
        native = sum(1 for s in kept[engine] if route[s.request_id] == "tgi_native")
        print(f"{engine}: {len(kept[engine])} measured ({native} TGI-native)")
        print(describe(errors[engine]))
    print(f"TGI decode steps ran {overhead * 1000:.2f} ms beyond their forward pass, on average")
    starved = [e for e in ENGINES if len(kept[e]) < MIN_SAMPLES]
    missed = [e for e in ENGINES if not all(errors[e][m].met(*TARGETS[m]) for m in ("ttft", "tpot"))]
    # Once (1 run in 18) SGLang got none after the warm-up; once (1 in 20) TGI's fit was off for a
    # whole run (docs/engines.md, "On a busy host"); causes not yet known: such a run explains itself.
    if starved or missed:
        print(f"left without their share: {starved}; targets missed: {missed}; the gateway's view:")
        print(json.dumps(state, indent=1, default=str))
    return Run(samples, route, kept, errors, service, overhead)


def _errors(samples: list[Sample]) -> dict[str, ErrorStats]:
    ttft = [
        (s.predicted_ttft_s, s.gateway_ttft_s)
        for s in samples
        if s.predicted_ttft_s is not None and s.gateway_ttft_s is not None and s.gateway_ttft_s > 0
    ]
    tpot = [
        (s.predicted_tpot_s, s.client_tpot_s)
        for s in samples
        if s.predicted_tpot_s is not None and s.client_tpot_s is not None and s.client_tpot_s > 0
    ]
    return {"ttft": error_stats(ttft), "tpot": error_stats(tpot)}


def test_every_engine_served_and_forecast_its_share(run: Run) -> None:
    assert all(s.status == 200 for s in run.samples), Counter(s.status for s in run.samples)
    served = Counter(s.replica for s in run.samples)
    assert set(served) == set(ENGINES), served
    assert min(served.values()) >= MIN_SERVED, served
    native = [s for s in run.samples if run.route[s.request_id] == "tgi_native"]
    assert native, "TGI's native clients were served"
    assert {s.replica for s in native} == {"tgi"}, "TGI's native API reaches TGI only"
    late = [s for s in run.samples if s.sent_at >= min(x.sent_at for x in run.samples) + WARMUP_S]
    forecast_ok = sum(len(v) for v in run.kept.values())
    assert forecast_ok >= 0.95 * len(late), Counter(s.prediction for s in late)
    for engine in ENGINES:
        fit = run.service.report(engine)
        assert fit is not None, engine
        assert fit.valid, (engine, fit)
        assert fit.observations_total > 10, (engine, fit)


def test_tgi_context_length_comes_from_its_info(run: Run) -> None:
    described = run.service.describe()["replicas"]
    assert isinstance(described, dict)
    for engine in ENGINES:
        assert described[engine]["facts"]["max_model_len"] == MAX_MODEL_LEN, engine


# Not a batch of one: with eight clients over three engines TGI's running batch is rarely one,
# so the fit there is an extrapolation of its intercept, not a check of what it learned (it fell
# outside 15 % in 2 of 7 runs on 2026-11-30, once 6.67 ms against 7.06 ms forward + 0.96 ms late).
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_tgi_fit_matches_the_emulators_step_times(run: Run, batch: int) -> None:
    """The TGI replica's step model, fitted from its measured step durations and batch sizes,
    against the emulator's cost model for decode steps of ``batch`` sequences of 600 tokens of
    context (the run's typical): between the forward pass alone and the forward pass plus the mean
    cycle overhead the emulator itself reported (its loop's lateness on this busy box, part of the
    steps the tokens see but not of every one: a mean over the run, while the fit weighs the
    windows it kept), within 15 % either side."""
    model = run.service.step_model("tgi")
    assert model is not None
    assert model.valid
    context = 600
    forward = CostModel(load_profile(PROFILE)).step_time_s(StepShape(decode_contexts=(context,) * batch))
    fitted = model.step_time(StepBatch(0.0, batch, batch * context, 0.0))
    late = forward + run.tgi_decode_overhead_s
    assert 0.85 * forward <= fitted <= 1.15 * late, (forward, late, fitted)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("metric", ["ttft", "tpot"])
def test_forecast_error_within_target(run: Run, engine: str, metric: str) -> None:
    errors = run.errors[engine][metric]
    assert errors.n >= MIN_SAMPLES
    assert errors.met(*TARGETS[metric]), describe({metric: errors})
