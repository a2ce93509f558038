"""Two tenants saturating one emulated replica through a real gateway: who got the GPU.

Real processes only: an emulated Llama-3-8B/H100 replica whose engine takes ``ENGINE_SEQS``
sequences at once, a ``sluice serve --config`` gateway with two tenants (``docs`` and ``chat``,
each with its API key and fair-share weight), and closed-loop clients in the test process:
``docs`` sends long documents (``DOCS``: long prompt, short answer), ``chat`` short chats
(``CHAT``). Every request is a non-streamed ``/v1/completions`` call whose prompt is token ids
(so the gateway's prompt estimate is exact) with ``ignore_eos`` (so the answer is exactly
``max_tokens`` long).

The gateway holds at most ``SLOTS`` requests on the replica at once (the class's
``slot_share``); the targets are so loose that nothing else binds and nothing is refused. Each
tenant runs more clients than there are slots, so while the load runs both tenants always have
requests waiting in the gateway's queue (pigeonhole: a tenant's waiting requests >= its
outstanding requests - ``SLOTS``), and the queue alone decides who is served next.

**GPU time is measured on the replica, not computed from tokens.** The replica is the real
simulator (``simulator.server.build_app``) with ``GpuTimeEngine``, which splits every engine
step's duration among the sequences in it (see its docstring) and adds each request's part to
its prompt length (the tenants' prompts differ in length); ``GET /gpu_seconds`` returns the
totals, which the load's sampler reads every 0.25 s. A tenant's GPU time over a window is the
increase of its total between the window's first and last samples: what its requests used of
the replica's busy time there, finished or not.

The gateway weighs tokens by GPU time (``limits.token_weights: {mode: gpu_time}``: the step
model's prices at the reference batch, ``gateway.tenants.pricing.GpuTimeWeights``) unless
``gateway_config`` pins them.

``python -m tests.integration.tenancy.fair_share`` (``main``) runs the scenarios of the test
once more, plus fixed VTC weights (1 : 2), and prints each tenant's GPU-time share;
``python -m tests.integration.tenancy.fair_share replica --profile P --port N --seed S`` is the
replica the test starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml
from aiohttp import web

import simulator.replica
import simulator.server
from gateway.admission import TokenWeights
from gateway.tenants import hash_api_key
from simulator.costmodel import CostModel, StepShape
from simulator.engine import Engine, StepPlan
from simulator.profile import Profile, load_profile
from tests.support.procs import ROOT, Proc, free_port, python_module

MODEL: Final = "meta-llama/Meta-Llama-3-8B-Instruct"
#: Sequences the emulated engine runs at once (vLLM's --max-num-seqs).
ENGINE_SEQS: Final = 16
#: The class's share of the replica's decode slots: floor(0.99 x 16) = 15 requests at once.
SLOT_SHARE: Final = 0.99
SLOTS: Final = 15
#: Seconds between two samples of the gateway's queue and the replica's engine.
SAMPLE_EVERY_S: Final = 0.25


@dataclass(frozen=True)
class Shape:
    """A tenant's requests: prompt and output tokens, and how many clients send them."""

    prompt_tokens: int
    output_tokens: int
    clients: int


#: Long documents: 4000-token prompts, 16-token answers (about 0.1 s of an H100 each).
DOCS: Final = Shape(prompt_tokens=4000, output_tokens=16, clients=24)
#: Short chats: 100-token prompts, 20-token answers (about 0.015 s of an H100 each).
CHAT: Final = Shape(prompt_tokens=100, output_tokens=20, clients=24)
SHAPES: Final = {"docs": DOCS, "chat": CHAT}
KEYS: Final = {"docs": "sk-fairness-docs-5b1f", "chat": "sk-fairness-chat-8d2e"}


def engine_profile(directory: Path, max_num_seqs: int = ENGINE_SEQS) -> Path:
    """The shipped ``llama3-8b-h100`` profile launched with ``--max-num-seqs max_num_seqs``."""
    data = yaml.safe_load((ROOT / "config" / "profiles" / "llama3-8b-h100.yaml").read_text())
    data["name"] = f"llama3-8b-h100-seqs{max_num_seqs}"
    data["engine"]["max_num_seqs"] = max_num_seqs
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Running:
    """A started process and the URL it serves."""

    proc: Proc
    url: str


@contextlib.contextmanager
def emulator(directory: Path, seed: int = 3) -> Iterator[Running]:
    """The emulated replica that measures GPU time (``serve_replica``, its own process)."""
    port = free_port()
    args = python_module(
        "tests.integration.tenancy.fair_share",
        "replica",
        "--profile",
        str(engine_profile(directory)),
        "--port",
        str(port),
        "--seed",
        str(seed),
    )
    proc = Proc(args, name="emulator")
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        yield Running(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.stop()


def gateway_config(
    replica_url: str,
    weights: Mapping[str, float],
    fairness: str = "tokens",
    *,
    token_weights: TokenWeights | None = None,
) -> dict[str, Any]:
    """One replica, one class whose only binding limit is ``SLOTS`` requests at once, the two
    tenants with their keys and ``weights``, the queue's fair share counting ``fairness``.
    ``token_weights``: pinned as ``limits.token_weights`` (what budgets and fair share charge per
    prompt and output token); ``None`` (default): GPU-time weighting, the gateway's step-model
    prices (``{mode: gpu_time}``, free to follow the fit within the run)."""
    hardware = {
        "gpu": "H100-SXM",
        "model": "Llama-3-8B",
        "max_num_seqs": ENGINE_SEQS,
        "max_num_batched_tokens": 8192,
    }
    patient = {
        "ttft_target_s": 300.0,
        "tpot_target_s": 1.0,
        "max_queue_wait_s": 300.0,
        "queue_capacity": 10_000,
        "slot_share": SLOT_SHARE,
    }
    unlimited = {"tokens_per_minute": 1e12, "requests_per_minute": 1e9, "max_concurrent": 10_000}
    limits: dict[str, Any] = {"token_weights": {"mode": "gpu_time", "max_change_per_minute": 1.0}}
    if token_weights is not None:
        limits["token_weights"] = {"prompt": token_weights.input, "output": token_weights.output}
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "shutdown_grace_s": 1.0},
        "replicas": [{"name": "emu", "url": replica_url, "hardware": hardware}],
        "health": {"interval_s": 1.0, "timeout_s": 1.0},
        "scrape": {"interval_s": 0.5, "timeout_s": 0.5, "window_s": 5.0},
        "reload": {"watch": False},
        "logging": {"level": "WARNING", "access_log": False},
        "admission": {
            "classes": {"shared": patient},
            "default_class": "shared",
            "queue": {"fairness": fairness},
        },
        "limits": limits,
        "tenants": {
            "tenants": {
                name: {"api_keys": [hash_api_key(KEYS[name])], "weight": weights[name], "limits": unlimited}
                for name in SHAPES
            }
        },
    }


@contextlib.contextmanager
def gateway(directory: Path, config: Mapping[str, Any]) -> Iterator[Running]:
    """``sluice serve --config`` (its own process), ready and listing the replica's model."""
    path = directory / f"sluice-{config['server']['port']}.yaml"
    path.write_text(yaml.safe_dump(dict(config)))
    proc = Proc(python_module("gateway.cli", "serve", "--config", str(path)), name="gateway")
    url = f"http://127.0.0.1:{config['server']['port']}"
    try:
        proc.wait_http(f"{url}/readyz", timeout_s=60)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            listing = urllib.request.Request(
                url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['docs']}"}
            )
            with urllib.request.urlopen(listing, timeout=5) as resp:
                if b'"id"' in resp.read():
                    break
            time.sleep(0.1)
        yield Running(proc, url)
    finally:
        proc.stop()


@dataclass(frozen=True)
class Answer:
    """One request as its client saw it (seconds since the run's start)."""

    tenant: str
    sent_at: float
    done_at: float
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Sample:
    """The gateway's queue and the replica's engine at one moment (seconds since the start).

    ``replica_s``: each tenant's seconds of the replica's time so far, and ``busy_s`` all of it
    (``GpuTimeEngine.replica_s``); ``engine_s``, ``engine_busy_s``: the same in the emulated
    engine's step durations alone (``GpuTimeEngine.engine_s``). ``charged``: each tenant's
    weighted tokens charged so far (the gateway's ``sluice_tenant_tokens_settled_total``: the
    weights in force at each request's admission, as its fair-share counter was charged).
    """

    at: float
    queued: float
    running: float
    waiting: float
    replica_s: dict[str, float]
    busy_s: float
    engine_s: dict[str, float]
    engine_busy_s: float
    charged: dict[str, float]


@dataclass
class LoadRun:
    """Everything one load run recorded; times are seconds since ``started_at`` (monotonic)."""

    started_at: float
    answers: list[Answer] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def finished_in(self, start_s: float, end_s: float) -> list[Answer]:
        """200 answers that arrived in ``[start_s, end_s)``."""
        return [a for a in self.answers if a.status == 200 and start_s <= a.done_at < end_s]

    def window(self, start_s: float, end_s: float) -> list[Sample]:
        """The samples taken in ``[start_s, end_s)``."""
        return [s for s in self.samples if start_s <= s.at < end_s]

    def gpu(self, start_s: float, end_s: float, *, engine: bool = False) -> dict[str, float]:
        """Each tenant's GPU seconds between the window's first and last samples: of the
        replica's time, or with ``engine`` of the emulated step durations alone."""
        window = self.window(start_s, end_s)
        first, last = window[0], window[-1]
        if engine:
            return {t: last.engine_s[t] - first.engine_s[t] for t in SHAPES}
        return {t: last.replica_s[t] - first.replica_s[t] for t in SHAPES}

    def busy(self, start_s: float, end_s: float, *, engine: bool = False) -> float:
        """The fraction (0-1) of the time between the window's first and last samples that the
        replica was busy (with ``engine``: that its emulated steps took)."""
        window = self.window(start_s, end_s)
        first, last = window[0], window[-1]
        if engine:
            return (last.engine_busy_s - first.engine_busy_s) / (last.at - first.at)
        return (last.busy_s - first.busy_s) / (last.at - first.at)

    def shares(self, start_s: float, end_s: float, *, engine: bool = False) -> dict[str, float]:
        """Each tenant's share (0-1) of the GPU time the two used in the window (``gpu``)."""
        gpu = self.gpu(start_s, end_s, engine=engine)
        total = sum(gpu.values())
        return {t: v / total for t, v in gpu.items()}

    def charged(self, start_s: float, end_s: float) -> dict[str, float]:
        """Each tenant's share (0-1) of the weighted tokens the gateway charged in the window."""
        window = self.window(start_s, end_s)
        first, last = window[0], window[-1]
        charged = {t: last.charged[t] - first.charged[t] for t in SHAPES}
        total = sum(charged.values())
        return {t: v / total if total > 0 else 0.0 for t, v in charged.items()}

    def one_request(self, start_s: float, end_s: float) -> float:
        """The share (0-1) of the window's charged tokens that one request of the costlier tenant
        settles on average: ``charged``'s granularity. Charges land when a request settles, so a
        window edge between two settlements moves a share by up to one request's worth, and on
        a slow machine the window holds fewer requests."""
        window = self.window(start_s, end_s)
        first, last = window[0], window[-1]
        charged = {t: last.charged[t] - first.charged[t] for t in SHAPES}
        total = sum(charged.values())
        counts = self.counts(start_s, end_s)
        per_request = [charged[t] / counts[t] for t in SHAPES if counts[t] > 0]
        return max(per_request) / total if per_request and total > 0 else 1.0

    def counts(self, start_s: float, end_s: float) -> dict[str, int]:
        """Each tenant's requests finished in the window."""
        out = dict.fromkeys(SHAPES, 0)
        for a in self.finished_in(start_s, end_s):
            out[a.tenant] += 1
        return out


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(tokens)]


async def drive(
    gateway_url: str,
    replica_url: str,
    duration_s: float,
    *,
    shapes: Mapping[str, Shape] = SHAPES,
    joins_s: Mapping[str, float] | None = None,
    seed: int = 11,
) -> LoadRun:
    """Every tenant's clients (``shapes``), closed loop (one request at a time each), from the
    tenant's ``joins_s`` (seconds after the start; default 0) until ``duration_s``, when every
    client hangs up; meanwhile, every ``SAMPLE_EVERY_S``, the gateway's queue length, the
    engine's running/waiting counts and the replica's GPU seconds per tenant."""
    run = LoadRun(time.monotonic())
    stop_at = run.started_at + duration_s
    clients = sum(shape.clients for shape in shapes.values())
    connector = aiohttp.TCPConnector(limit=clients + 4)
    timeout = aiohttp.ClientTimeout(total=duration_s + 120.0)
    tenant_of = {shape.prompt_tokens: tenant for tenant, shape in SHAPES.items()}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(tenant: str, index: int) -> None:
            shape = shapes[tenant]
            rng = random.Random(f"{seed}-{tenant}-{index}")
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
            await asyncio.sleep((joins_s or {}).get(tenant, 0.0))
            while time.monotonic() < stop_at:
                body = {
                    "model": MODEL,
                    "prompt": _prompt(rng, shape.prompt_tokens),
                    "max_tokens": shape.output_tokens,
                    "ignore_eos": True,
                }
                sent = time.monotonic() - run.started_at
                try:
                    async with session.post(
                        gateway_url + "/v1/completions", json=body, headers=headers
                    ) as resp:
                        payload = await resp.json(content_type=None)
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    run.errors.append(f"{tenant}: {exc!r}")
                    await asyncio.sleep(0.05)
                    continue
                done = time.monotonic() - run.started_at
                if status != 200:
                    run.errors.append(f"{tenant}: {status} {payload}")
                    run.answers.append(Answer(tenant, sent, done, status))
                    await asyncio.sleep(0.05)
                    continue
                usage = payload["usage"]
                run.answers.append(
                    Answer(tenant, sent, done, status, usage["prompt_tokens"], usage["completion_tokens"])
                )

        async def sampler() -> None:
            while time.monotonic() < stop_at:
                at = time.monotonic() - run.started_at
                async with session.get(replica_url + "/gpu_seconds") as resp:
                    gpu = await resp.json()
                async with session.get(gateway_url + "/metrics") as resp:
                    gateway_text = await resp.text()
                queued = _metric(gateway_text, "sluice_queue_length")
                charged = {
                    t: _metric(gateway_text, f'sluice_tenant_tokens_settled_total{{tenant="{t}"}}')
                    for t in SHAPES
                }
                async with session.get(replica_url + "/metrics") as resp:
                    replica_text = await resp.text()
                running = _metric(replica_text, "vllm:num_requests_running")
                waiting = _metric(replica_text, "vllm:num_requests_waiting")
                replica_s, engine_s = dict.fromkeys(SHAPES, 0.0), dict.fromkeys(SHAPES, 0.0)
                for prompt, seconds in gpu["replica_s"].items():
                    replica_s[tenant_of[int(prompt)]] += seconds
                for prompt, seconds in gpu["engine_s"].items():
                    engine_s[tenant_of[int(prompt)]] += seconds
                run.samples.append(
                    Sample(
                        at,
                        queued,
                        running,
                        waiting,
                        replica_s,
                        gpu["busy_s"],
                        engine_s,
                        gpu["engine_busy_s"],
                        charged,
                    )
                )
                await asyncio.sleep(SAMPLE_EVERY_S)

        tasks = [
            asyncio.create_task(client(t, i)) for t, shape in shapes.items() for i in range(shape.clients)
        ]
        await sampler()
        # Hang up on what is still waiting or running: the gateway drops it (no drain to wait for).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return run


def _metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (a metric name, or a name with its labels) in a
    Prometheus text exposition; 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ", ","):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- the replica, with each request's GPU time ----------------------------------------------------


class GpuTimeEngine(Engine):
    """The simulator's engine, also adding up the replica time each request used, by prompt length.

    Each step is split among the sequences in it by the cost model's own terms
    (``simulator.costmodel.CostModel.step_time_s``): what the step costs whatever it carries (the
    step overhead, the linear layers and all-reduces at one token, i.e. reading the weights, and
    the LM head) is shared equally by the sequences it serves; what its tokens add to the linear
    layers and all-reduces beyond that is paid per token computed; attention by the sequence
    whose KV it reads. So a decode pays its share of reading the weights and little more, and a
    long prefill chunk pays for its GEMMs; the parts of a step add up to the whole step.

    A step's *replica time* is from its start until the engine's next ``schedule`` (the next step,
    or idle): the emulated duration plus whatever the replica's process did around it (on a
    loaded machine, a good part of it: emitting the step's tokens, answering requests, waiting
    for a CPU). The emulated duration is split as above; the rest is a cost of the step, not of
    its tokens' compute, so it is shared equally by the step's sequences, like the step's fixed
    overhead (a 4000-token prefill chunk does not make the process slower to wake up). A real
    engine's step time holds its CPU work too, and the gateway's step model learns these times
    (as a per-step cost: its ``base``). ``kind_s``, ``kind_tokens``: the same replica seconds,
    and the tokens computed, by prompt length and kind (``"prefill"`` chunks, ``"decode"``
    tokens): each kind's realised price per token.
    ``replica_s[prompt tokens]``: replica seconds so far of the requests with that prompt length;
    ``busy_s``: all of it. ``engine_s`` and ``engine_busy_s``:
    the same in emulated step durations alone (jitter included).
    """

    def __init__(self, profile: Profile, *, seed: int | None = None, jitter: float = 0.0) -> None:
        super().__init__(profile, seed=seed, jitter=jitter)
        self.replica_s: dict[int, float] = {}
        self.busy_s = 0.0
        self.engine_s: dict[int, float] = {}
        self.engine_busy_s = 0.0
        #: Replica seconds and tokens computed, by prompt length and kind ("prefill", "decode").
        self.kind_s: dict[tuple[int, str], float] = {}
        self.kind_tokens: dict[tuple[int, str], int] = {}
        #: The step in progress: its start, emulated duration and each sequence's emulated part
        #: of it, by prompt length.
        self._current: tuple[float, float, list[tuple[int, float, str, int]]] | None = None

    def schedule(self, now: float) -> StepPlan | None:
        if self._current is not None:
            started, duration, parts = self._current
            span = max(0.0, now - started)
            # The emulated duration by the cost model's terms; what the replica took beyond it
            # (its own per-step work and waits) shared equally, like the step's fixed overhead.
            scale, extra = min(span, duration) / duration, max(0.0, span - duration) / len(parts)
            for prompt, part, kind, tokens in parts:
                key = (prompt, kind)
                seconds = part * scale + extra
                self.replica_s[prompt] = self.replica_s.get(prompt, 0.0) + seconds
                self.kind_s[key] = self.kind_s.get(key, 0.0) + seconds
                self.kind_tokens[key] = self.kind_tokens.get(key, 0) + tokens
            self.busy_s += span
            self._current = None
        plan = super().schedule(now)
        if plan is not None:
            parts = self._parts(plan)
            for prompt, part, _, _ in parts:
                self.engine_s[prompt] = self.engine_s.get(prompt, 0.0) + part
            self.engine_busy_s += plan.duration_s
            self._current = (now, plan.duration_s, parts)
        return plan

    def _parts(self, plan: StepPlan) -> list[tuple[int, float, str, int]]:
        """(prompt tokens, seconds, kind, tokens computed) of every sequence in ``plan`` (kind
        ``"decode"`` or ``"prefill"``); the seconds add up to its duration."""
        model = self.cost_model
        assert isinstance(model, CostModel), "the per-layer cost model: a profile without step_model"
        work: list[tuple[int, int, float, str]] = []  # (prompt, tokens computed, own attention s, kind)
        chunks: list[tuple[int, int]] = []
        decodes: list[int] = []
        for request_id, num_new in plan.num_scheduled_tokens.items():
            req = self._in_flight_requests[request_id]
            context = req.num_computed_tokens
            if num_new == 1 and req.num_output_tokens > 0 and context == req.num_tokens - 1:
                decodes.append(context + 1)
                own, kind = model.decode_attention_s((context + 1,)), "decode"
            else:
                chunks.append((num_new, context))
                own, kind = model.prefill_attention_s(((num_new, context),)), "prefill"
            work.append((req.prompt_tokens, num_new, own, kind))
        shape = StepShape(prefill_chunks=tuple(chunks), decode_contexts=tuple(decodes))
        tokens, seqs = shape.num_tokens, shape.num_seqs
        fixed = (
            self.profile.cost.per_step_overhead_s
            + model.linear_s(1)
            + model.allreduce_s(1)
            + model.lm_head_s(seqs)
        )
        added = model.linear_s(tokens) + model.allreduce_s(tokens) - model.linear_s(1) - model.allreduce_s(1)
        per_seq, per_token = fixed / seqs, max(0.0, added) / tokens
        parts = [(prompt, per_seq + per_token * n + own, kind, n) for prompt, n, own, kind in work]
        scale = plan.duration_s / sum(part for _, part, _, _ in parts)  # the step's jitter
        return [(prompt, part * scale, kind, n) for prompt, part, kind, n in parts]


async def _gpu_seconds(request: web.Request) -> web.Response:
    """``GET /gpu_seconds``: ``GpuTimeEngine``'s totals so far, prompt lengths as strings:
    ``{"busy_s": s, "replica_s": {"4000": s, ...}, "engine_busy_s": s, "engine_s": {...},
    "kind_s": {"4000/prefill": s, "4000/decode": s, ...}, "kind_tokens": {"4000/prefill": n, ...}}``."""
    engine = request.app[simulator.replica.REPLICA].engine
    assert isinstance(engine, GpuTimeEngine)
    body = {
        "busy_s": engine.busy_s,
        "replica_s": {str(k): v for k, v in engine.replica_s.items()},
        "engine_busy_s": engine.engine_busy_s,
        "engine_s": {str(k): v for k, v in engine.engine_s.items()},
        "kind_s": {f"{p}/{k}": v for (p, k), v in engine.kind_s.items()},
        "kind_tokens": {f"{p}/{k}": v for (p, k), v in engine.kind_tokens.items()},
    }
    return web.json_response(body)


def serve_replica(profile: str, port: int, seed: int) -> None:
    """The real emulated replica (``simulator.server.build_app``, vLLM's API and ``/metrics``)
    with ``GpuTimeEngine`` as its engine and ``GET /gpu_seconds``, on ``127.0.0.1:port`` until
    SIGTERM or SIGINT."""
    simulator.replica.Engine = GpuTimeEngine  # type: ignore[attr-defined]  # its replicas use ours
    app = simulator.server.build_app(load_profile(profile), seed=seed)
    app.router.add_get("/gpu_seconds", _gpu_seconds)
    web.run_app(app, host="127.0.0.1", port=port, handler_cancellation=True, access_log=None, print=None)


# --- the scenarios once more, by hand: ``python -m tests.integration.tenancy.fair_share`` ---------


def main(load_s: float = 20.0, warmup_s: float = 8.0) -> None:
    """Run the two tenants together (weights 1 : 1) with token fairness at the gateway's own
    weights, at VTC's fixed 1 : 2, and with request fairness, and print each tenant's requests
    served and the documents' share of the replica's time and of the emulated GPU's."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="sluice-fair-"))
    even = {"docs": 1.0, "chat": 1.0}
    scenarios: list[tuple[str, str, TokenWeights | None]] = [
        ("tokens, step-model weights", "tokens", None),
        ("tokens, VTC 1 : 2", "tokens", TokenWeights(input=1.0, output=2.0)),
        ("requests", "requests", None),
    ]
    with emulator(directory) as replica:
        for label, fairness, pinned in scenarios:
            config = gateway_config(replica.url, even, fairness, token_weights=pinned)
            with gateway(directory, config) as gw:
                run = asyncio.run(drive(gw.url, replica.url, load_s))
            counts = run.counts(warmup_s, load_s)
            docs = run.shares(warmup_s, load_s)["docs"]
            engine = run.shares(warmup_s, load_s, engine=True)["docs"]
            busy, engine_busy = run.busy(warmup_s, load_s), run.busy(warmup_s, load_s, engine=True)
            print(
                f"{label:28s} docs:chat requests {counts['docs']}:{counts['chat']} | docs share: "
                f"replica time {docs:.3f}, emulated GPU {engine:.3f} | replica busy {busy:.2f}, "
                f"emulated GPU busy {engine_busy:.2f}"
            )


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def prices(docs_weight: float, runs: int, load_s: float = 20.0, warmup_s: float = 8.0) -> None:
    """Token fairness at ``docs_weight`` : 1, ``runs`` times, each with a fresh gateway in front
    of one replica: the documents' share of the replica's time; what one document costs against
    one chat, on the replica (its realised seconds per request) and as the gateway charged them
    (its weighted tokens per request); the replica's realised seconds per token of each kind
    (over the whole run, warm-up included); and the gateway's fitted step model at the end."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="sluice-prices-"))
    weights = {"docs": docs_weight, "chat": 1.0}
    with emulator(directory) as replica:
        for index in range(runs):
            before = _json(replica.url + "/gpu_seconds")
            with gateway(directory, gateway_config(replica.url, weights)) as gw:
                run = asyncio.run(drive(gw.url, replica.url, load_s))
                view = _json(gw.url + "/sluice/v1/replicas")
            after = _json(replica.url + "/gpu_seconds")
            counts, gpu, charged = (
                run.counts(warmup_s, load_s),
                run.gpu(warmup_s, load_s),
                run.charged(warmup_s, load_s),
            )
            realised = (gpu["docs"] / counts["docs"]) / (gpu["chat"] / counts["chat"])
            billed = (charged["docs"] / counts["docs"]) / (charged["chat"] / counts["chat"])
            per_token = {
                kind: 1e6 * (after["kind_s"][kind] - before["kind_s"].get(kind, 0.0)) / tokens
                for kind in after["kind_s"]
                if (tokens := after["kind_tokens"][kind] - before["kind_tokens"].get(kind, 0)) > 0
            }
            params = view["prediction"]["replicas"]["emu"]["fit"]["params"]
            fit = {k: float(v) for k, v in params.items()}
            print(
                f"run {index + 1}: docs share of replica time {run.shares(warmup_s, load_s)['docs']:.3f} "
                f"(target {docs_weight / (docs_weight + 1.0):.3f}) | a document costs {realised:.2f} chats "
                f"on the replica, charged {billed:.2f}"
            )
            print(
                "  replica us per token: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_token.items()))
            )
            base, below, past = fit["base"] * 1e3, fit["tokens_to_knee"] * 1e6, fit["tokens_past_knee"] * 1e6
            seq, kv, knee = fit["decode_seqs"] * 1e6, fit["kv_tokens"] * 1e9, fit["knee_tokens"]
            print(
                f"  fit: base {base:.2f} ms, per token {below:.1f} us, past the knee ({knee:.0f} tokens)"
                f" {past:.1f} us, per decode {seq:.1f} us, per KV token {kv:.1f} ns"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["prices"]:
        parser = argparse.ArgumentParser(prog="fair_share prices")
        parser.add_argument("--docs-weight", type=float, default=2.0)
        parser.add_argument("--runs", type=int, default=3)
        args = parser.parse_args(sys.argv[2:])
        prices(args.docs_weight, args.runs)
    elif sys.argv[1:2] == ["replica"]:
        parser = argparse.ArgumentParser(prog="fair_share replica")
        parser.add_argument("--profile", required=True)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--seed", type=int, default=3)
        args = parser.parse_args(sys.argv[2:])
        serve_replica(args.profile, args.port, args.seed)
    else:
        main()
