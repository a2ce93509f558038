"""Live forecast runs on the replica emulator, behind the real gateway served in this process.

Two scenarios, each returning every request's forecast and outcome (``bench.live_accuracy``):

* ``single_run``: one emulated vLLM (``llama3-8b-h100``), closed-loop streaming clients in this
  process and loop;
* ``fleet_run``: an emulated vLLM, TGI and SGLang (same profile, same model) behind one gateway;
  OpenAI-SDK clients routed anywhere and TGI-native ``/generate_stream`` clients (TGI only), run
  in their own process (``drive``) so that the SDK's per-chunk work does not slow the gateway's
  loop they measure.

The gateway knows only what an operator would (an H100-SXM serving Llama-3-8B with vLLM's engine
limits); admission's ``forecast_margin`` is 0, so the ``x-sluice-predicted-*`` headers carry the
predictor's own forecast. ``python -m bench.live_accuracy`` runs both at full size against its
targets; ``tests/integration`` runs them small, as behaviour checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import openai
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.live_accuracy import (
    ErrorStats,
    Sample,
    Workload,
    accuracy,
    closed_loop,
    enough_measured,
    measured,
    sample_from,
    serve_gateway,
    wait_until_ready,
)
from gateway.admission.config import AdmissionSettings, ClassSettings
from gateway.config.settings import LoggingSettings, ServerSettings, Settings
from gateway.keys import PREDICTION_SERVICE, REGISTRY
from gateway.prediction import PredictionService
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings
from gateway.replicas.registry import ReplicaState

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "llama3-8b-h100"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the profile's served_model_name
MAX_MODEL_LEN = 8192  # the profile's
#: What an operator who launched vLLM for this replica knows (config/profiles/llama3-8b-h100.yaml).
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
ENGINES: tuple[Literal["vllm", "tgi", "sglang"], ...] = ("vllm", "tgi", "sglang")
#: The single replica's name in the gateway's settings.
SINGLE_REPLICA = "emu"
THINK_S = 0.05
#: The fleet's prompts: 600-5000 characters, 120-1000 tokens to the emulator (median ~550), nearer
#: chat prompts than 200-3000, where the host's scheduling was a third of a first token
#: (docs/engines.md, "On a busy host").
FLEET_WORKLOAD = Workload(MODEL, prompt_chars=(600, 5000))
#: Loose class targets: nothing is refused however slow the host, and the engines' slacks differ by
#: far less than 1 % of a target, so requests go where the gateway has the fewest (``_SLACK_TIE``).
#: No forecast margin: the headers then carry the predictor's own forecast.
FLEET_ADMISSION = AdmissionSettings(
    forecast_margin=0.0,
    classes={"interactive": ClassSettings(ttft_target_s=5.0, tpot_target_s=50.0, max_queue_wait_s=30.0)},
)


@contextlib.contextmanager
def emulators(engines: Mapping[str, str], *, jitter: float = 0.02) -> Iterator[dict[str, str]]:
    """One emulator process per name in ``engines`` (name -> ``--engine``), seeds 1, 2, ...; yields
    name -> base URL once every one answers ``/health``; stops them all on exit."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Any] = {}
    urls: dict[str, str] = {}
    try:
        for seed, (name, engine) in enumerate(engines.items(), start=1):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            args = [sys.executable, "-m", "simulator", "--profile", PROFILE, "--port", str(port),
                    "--seed", str(seed), "--jitter", str(jitter), "--engine", engine]  # fmt: skip
            logs[name] = tempfile.NamedTemporaryFile(prefix=f"sluice-emulator-{name}-", suffix=".log")  # noqa: SIM115
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            procs[name] = subprocess.Popen(
                args, stdout=logs[name], stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
            urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in procs.items():
            _wait_http(urls[name] + "/health", proc, Path(logs[name].name))
        yield urls
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for log in logs.values():
            log.close()


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> None:
    """Poll ``url`` until it answers 200; raise with the process's log if it exits or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=1.0) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _settings(replicas: list[ReplicaSettings], admission: AdmissionSettings) -> Settings:
    return Settings(
        server=ServerSettings(port=0),
        replicas=replicas,
        health=HealthSettings(interval_s=1.0, timeout_s=1.0),
        logging=LoggingSettings(access_log=False),
        admission=admission,
    )


# -- one emulated vLLM ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SingleRun:
    """Every request (``samples``, gateway TTFTs filled in), those ``measured`` keeps after the
    warm-up (``kept``) and their errors by ``accuracy`` key."""

    samples: list[Sample]
    kept: list[Sample]
    errors: dict[str, ErrorStats]
    warmup_s: float


def single_run(
    *,
    concurrency: int,
    warmup_s: float,
    load_s: float = math.inf,
    wanted: int | None = None,
    max_requests: int | None = None,
    workload: Workload | None = None,
) -> SingleRun:
    """One emulator, one gateway, ``concurrency`` closed-loop clients in this loop (uvloop, as
    ``sluice serve`` runs) for ``load_s`` seconds, or, with ``wanted``, until ``wanted`` requests
    after ``warmup_s`` were measured (``max_requests`` sent after it at most)."""
    stop = None
    if wanted is not None:
        cap = max_requests if max_requests is not None else 4 * wanted
        stop = enough_measured([SINGLE_REPLICA], warmup_s=warmup_s, wanted=wanted, max_requests=cap)

    async def measure(url: str) -> list[Sample]:
        replica = ReplicaSettings(name=SINGLE_REPLICA, url=url, hardware=HARDWARE)
        async with serve_gateway(_settings([replica], AdmissionSettings(forecast_margin=0.0))) as gateway:
            await wait_until_ready(gateway.url, MODEL)
            samples = await closed_loop(
                gateway.url,
                workload or Workload(MODEL),
                concurrency=concurrency,
                duration_s=load_s,
                think_s=THINK_S,
                seed=3,
                stop=stop,
            )
            return gateway.with_gateway_ttft(samples)

    with (
        emulators({SINGLE_REPLICA: "vllm"}) as urls,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        samples = runner.run(measure(urls[SINGLE_REPLICA]))
    kept = measured(samples, warmup_s=warmup_s)
    return SingleRun(samples, kept, accuracy(kept), warmup_s)


# -- a mixed fleet ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetLoad:
    """The fleet's clients and when they stop: after ``warmup_s`` plus ``min_load_s`` seconds, once
    every engine has ``wanted`` measured requests, or once ``max_requests`` were sent after the
    warm-up (a count, so a slow host makes the run longer, never a failure)."""

    openai_clients: int
    tgi_clients: int
    warmup_s: float
    wanted: int
    min_load_s: float = 0.0
    max_requests: int = 0

    @property
    def request_cap(self) -> int:
        """``max_requests``, or by default 10 times what the engines want between them."""
        return self.max_requests or 10 * self.wanted * len(ENGINES)


@dataclass(frozen=True)
class FleetRun:
    """The fleet's requests; ``route`` maps request ids to ``openai`` or ``tgi_native``; ``kept``
    and ``errors`` are by engine (``accuracy`` keys); ``service`` is the gateway's prediction
    service at the end; ``tgi_decode_overhead_s`` the mean seconds the TGI emulator's decode step
    cycles took beyond the cost model's forward pass; ``state`` the gateway's view at the end."""

    samples: list[Sample]
    route: Mapping[str, str]
    kept: Mapping[str, list[Sample]]
    errors: Mapping[str, dict[str, ErrorStats]]
    service: PredictionService
    tgi_decode_overhead_s: float
    state: Mapping[str, object]
    warmup_s: float


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
    tokens = usage if usage is not None else events
    status = raw.http_response.status_code
    return sample_from(
        rid, sent, prompt, max_tokens, status, raw.headers, first, last, tokens, completion_tokens=tokens
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
        return sample_from(
            rid,
            sent,
            prompt,
            max_tokens,
            resp.status,
            resp.headers,
            first,
            last,
            events,
            completion_tokens=events,
        )


async def _load(url: str, load: FleetLoad) -> tuple[list[Sample], dict[str, str]]:
    """The clients' closed loops, until ``load`` says stop."""
    samples: list[Sample] = []
    route: dict[str, str] = {}
    at_least = time.monotonic() + load.warmup_s + load.min_load_s
    enough = enough_measured(
        ENGINES, warmup_s=load.warmup_s, wanted=load.wanted, max_requests=load.request_cap
    )
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    total = load.openai_clients + load.tgi_clients
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def client(index: int) -> None:
            rng = random.Random(1000 + index)
            await asyncio.sleep(THINK_S * index / total)  # staggered: no burst at the start
            while time.monotonic() < at_least or not enough(samples):
                prompt, max_tokens = FLEET_WORKLOAD.draw(rng)
                if index < load.openai_clients:
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
    """Entry point of the load process: ``drive URL OUT LOAD_JSON`` runs ``_load`` against the
    gateway at URL and writes the samples and their routes to OUT as JSON."""
    url, out, load = sys.argv[1], sys.argv[2], FleetLoad(**json.loads(sys.argv[3]))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        samples, route = runner.run(_load(url, load))
    Path(out).write_text(json.dumps({"samples": [dataclasses.asdict(s) for s in samples], "route": route}))


async def _drive(url: str, out: Path, load: FleetLoad) -> tuple[list[Sample], dict[str, str]]:
    code = "from bench.live_runs import drive; drive()"
    args = (url, str(out), json.dumps(dataclasses.asdict(load)))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *args, cwd=ROOT)
    try:
        rc = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if rc != 0:
        raise RuntimeError(f"the load process failed ({rc})")
    data = json.loads(await asyncio.to_thread(out.read_text))
    return [Sample(**s) for s in data["samples"]], data["route"]


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


def fleet_run(load: FleetLoad) -> FleetRun:
    """Three emulators (vLLM, TGI, SGLang), one gateway in this process (uvloop), ``load``'s
    clients in their own process."""

    async def measure(urls: Mapping[str, str], out: Path) -> FleetRun:
        replicas = [ReplicaSettings(name=e, url=urls[e], backend=e, hardware=HARDWARE) for e in ENGINES]
        async with serve_gateway(_settings(replicas, FLEET_ADMISSION)) as gateway:
            await wait_until_ready(gateway.url, MODEL)
            registry = gateway.app[REGISTRY]
            for _ in range(300):  # every replica healthy, not only the first one
                if all(r.state == ReplicaState.HEALTHY for r in registry.replicas()):
                    break
                await asyncio.sleep(0.1)
            at_start = {r.name: r.state.value for r in registry.replicas()}
            samples, route = await _drive(gateway.url, out, load)
            overhead = await _decode_overhead_s(urls["tgi"])
            service = gateway.app[PREDICTION_SERVICE]
            state = {
                "health_at_start": at_start,
                "registry": registry.describe(),
                "prediction": service.describe()["replicas"],
            }
            samples = gateway.with_gateway_ttft(samples)
        good = measured(samples, warmup_s=load.warmup_s)
        kept: dict[str, list[Sample]] = {e: [s for s in good if s.replica == e] for e in ENGINES}
        errors: dict[str, dict[str, ErrorStats]] = {e: accuracy(kept[e]) for e in ENGINES}
        return FleetRun(samples, route, kept, errors, service, overhead, state, load.warmup_s)

    with (
        emulators({e: e for e in ENGINES}) as urls,
        tempfile.TemporaryDirectory(prefix="sluice-fleet-") as tmp,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        return runner.run(measure(urls, Path(tmp) / "samples.json"))
