"""Two tenants saturating one emulated replica through a real gateway: who got the GPU.

Real processes only: an emulated Llama-3-8B/H100 replica (``python -m simulator``) whose engine
takes ``ENGINE_SEQS`` sequences at once, a ``sluice serve --config`` gateway with two tenants
(``docs`` and ``chat``, each with its API key and fair-share weight), and closed-loop clients in
the test process: ``docs`` sends long documents (``DOCS`` tokens: long prompt, short answer),
``chat`` short chats (``CHAT``). Every request is a non-streamed ``/v1/completions`` call whose
prompt is token ids (so the gateway's prompt estimate is exact) with ``ignore_eos`` (so the
answer is exactly ``max_tokens`` long).

The gateway holds at most ``SLOTS`` requests on the replica at once (the class's
``slot_share``); the targets are so loose that nothing else binds and nothing is refused. Each
tenant runs more clients than there are slots, so while the load runs both tenants always have
requests waiting in the gateway's queue (pigeonhole: a tenant's waiting requests >= its
outstanding requests - ``SLOTS``), and the queue alone decides who is served next.

What a request costs the GPU is what the fair-share counters charge: ``w_in x prompt + w_out x
output`` with the budgets' token weights, which the config pins to the queue's default token
costs (``TokenWeights.from_queue_settings``; ``costs=UNPINNED`` leaves them to the step model).
A tenant's
GPU time over a window is the cost of its requests that finished in that window.

``python -m tests.integration.tenancy.fair_share`` (``main``) compares those weighted tokens with
the replica's own time, measured by letting each tenant alone saturate the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml

from gateway.admission import QueueSettings, TokenWeights
from gateway.tenants import hash_api_key
from tests.support.procs import ROOT, Proc, free_port, python_module

MODEL: Final = "meta-llama/Meta-Llama-3-8B-Instruct"
#: Sequences the emulated engine runs at once (vLLM's --max-num-seqs).
ENGINE_SEQS: Final = 16
#: The class's share of the replica's decode slots: floor(0.99 x 16) = 15 requests at once.
SLOT_SHARE: Final = 0.99
SLOTS: Final = 15


@dataclass(frozen=True)
class Shape:
    """A tenant's requests: prompt and output tokens, and how many clients send them."""

    prompt_tokens: int
    output_tokens: int
    clients: int


#: Long documents: 2000-token prompts, 16-token answers.
DOCS: Final = Shape(prompt_tokens=2000, output_tokens=16, clients=24)
#: Short chats: 100-token prompts, 100-token answers.
CHAT: Final = Shape(prompt_tokens=100, output_tokens=100, clients=24)
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
    """The emulated replica (its own process) on a free port."""
    port = free_port()
    args = python_module(
        "simulator",
        "--profile",
        str(engine_profile(directory)),
        "--port",
        str(port),
        "--seed",
        str(seed),
        "--log-level",
        "WARNING",
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
    costs: TokenWeights | None = None,
) -> dict[str, Any]:
    """One replica, one class whose only binding limit is ``SLOTS`` requests at once, the two
    tenants with their keys and ``weights``, the queue's fair share counting ``fairness``, with
    the queue's token ``costs`` (seconds per token; default: ``cost_weights()``), to which the
    budgets' token weights are pinned as well."""
    pinned = costs is not UNPINNED
    costs = costs if costs is not None and pinned else cost_weights()
    queue: dict[str, Any] = {"fairness": fairness}
    if pinned:
        queue |= {"prompt_token_cost_s": costs.input, "output_token_cost_s": costs.output}
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
            "queue": queue,
        },
        # The budgets (and so the fair share) weigh tokens with these; UNPINNED: with the fitted
        # step model's decode-to-prefill ratio, as by default.
        "limits": {"token_weights": {"prompt": 1.0, "output": costs.output / costs.input}} if pinned else {},
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
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if b'"id"' in resp.read():
                    break
            time.sleep(0.1)
        yield Running(proc, url)
    finally:
        proc.stop()


#: ``gateway_config(costs=UNPINNED)``: no token weights in the config (the gateway derives them).
UNPINNED: Final = TokenWeights(input=0.0, output=0.0, request=1.0)


def cost_weights() -> TokenWeights:
    """What a served request costs the GPU: what the gateway's fair-share counters charge per
    token in ``tokens`` mode (the queue's default token costs, seconds per token)."""
    return TokenWeights.from_queue_settings(QueueSettings(fairness="tokens"))


@dataclass(frozen=True)
class Answer:
    """One request as its client saw it (monotonic seconds)."""

    tenant: str
    sent_at: float
    done_at: float
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Sample:
    """The gateway's queue and the replica's engine at one moment."""

    at: float
    queued: float
    running: float
    waiting: float


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

    def gpu(self, start_s: float, end_s: float, weights: TokenWeights) -> dict[str, float]:
        """Each tenant's weighted tokens finished in the window."""
        out = dict.fromkeys(SHAPES, 0.0)
        for a in self.finished_in(start_s, end_s):
            out[a.tenant] += weights.cost(a.prompt_tokens, a.completion_tokens, 1.0)
        return out

    def shares(self, start_s: float, end_s: float, weights: TokenWeights) -> dict[str, float]:
        """Each tenant's share (0-1) of the weighted tokens finished in the window."""
        gpu = self.gpu(start_s, end_s, weights)
        total = sum(gpu.values())
        return {t: v / total for t, v in gpu.items()}

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
    client hangs up; meanwhile the gateway's queue length and the engine's running/waiting
    counts, every 0.25 s."""
    run = LoadRun(time.monotonic())
    stop_at = run.started_at + duration_s
    clients = sum(shape.clients for shape in shapes.values())
    connector = aiohttp.TCPConnector(limit=clients + 4)
    timeout = aiohttp.ClientTimeout(total=duration_s + 120.0)
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
                queued = await _metric(session, gateway_url + "/metrics", "sluice_queue_length")
                running = await _metric(session, replica_url + "/metrics", "vllm:num_requests_running")
                waiting = await _metric(session, replica_url + "/metrics", "vllm:num_requests_waiting")
                run.samples.append(Sample(at, queued, running, waiting))
                await asyncio.sleep(0.25)

        tasks = [
            asyncio.create_task(client(t, i)) for t, shape in shapes.items() for i in range(shape.clients)
        ]
        await sampler()
        # Hang up on what is still waiting or running: the gateway drops it (no drain to wait for).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return run


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of every sample of metric ``name`` in a Prometheus text exposition."""
    async with session.get(url) as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- a cross-check in replica time: ``python -m tests.integration.tenancy.fair_share`` ------------


def step_model_costs() -> TokenWeights:
    """The costs the budgets would weigh tokens with on this replica if not pinned: w_out / w_in =
    the step model's decode-to-prefill ratio (``gateway.tenancy.decode_to_prefill_ratio``, roofline
    prior of Llama-3-8B on H100, ``ENGINE_SEQS`` sequences), on the queue's prompt cost."""
    from gateway.prediction.facts import ReplicaFacts
    from gateway.tenancy import decode_to_prefill_ratio

    prior = ReplicaFacts(gpu="H100-SXM", model="Llama-3-8B", tensor_parallel=1).prior()
    ratio = decode_to_prefill_ratio(prior, max_num_batched_tokens=8192, max_num_seqs=ENGINE_SEQS)
    assert ratio is not None
    prompt = cost_weights().input
    return TokenWeights(input=prompt, output=prompt * ratio)


def _replica_shares(
    run: LoadRun, start_s: float, end_s: float, seconds: Mapping[str, float]
) -> dict[str, float]:
    counts = run.counts(start_s, end_s)
    used = {t: counts[t] * seconds[t] for t in counts}
    return {t: v / sum(used.values()) for t, v in used.items()}


def main(load_s: float = 15.0, warmup_s: float = 3.0) -> None:
    """Measure what one request of each tenant costs the replica (each tenant alone saturating
    the same ``SLOTS``: replica seconds per request = window / requests finished), then run the
    two tenants together under several fairness settings and print each tenant's share in the
    weighted tokens the gateway charges and in replica time."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="sluice-fair-"))
    scenarios = [
        ("tokens, queue costs", "tokens", cost_weights()),
        ("tokens, step-model costs", "tokens", step_model_costs()),
        ("requests", "requests", cost_weights()),
    ]
    even = {"docs": 1.0, "chat": 1.0}
    with emulator(directory) as replica:
        seconds: dict[str, float] = {}
        with gateway(directory, gateway_config(replica.url, even)) as gw:
            for tenant, shape in SHAPES.items():
                alone = asyncio.run(drive(gw.url, replica.url, load_s, shapes={tenant: shape}))
                done = alone.counts(warmup_s, load_s)[tenant]
                seconds[tenant] = (load_s - warmup_s) / done
                print(f"{tenant} alone: {done / (load_s - warmup_s):.1f} requests/s")
        print(f"replica seconds per request: { {t: round(v, 4) for t, v in seconds.items()} }")
        for label, fairness, costs in scenarios:
            with gateway(directory, gateway_config(replica.url, even, fairness, costs=costs)) as gw:
                run = asyncio.run(drive(gw.url, replica.url, load_s))
            counts = run.counts(warmup_s, load_s)
            charged = run.shares(warmup_s, load_s, cost_weights())
            model = run.shares(warmup_s, load_s, step_model_costs())
            real = _replica_shares(run, warmup_s, load_s, seconds)
            print(
                f"{label:26s} docs:chat requests {counts['docs']}:{counts['chat']} | docs share: "
                f"queue-cost tokens {charged['docs']:.3f}, step-model tokens {model['docs']:.3f}, "
                f"replica time {real['docs']:.3f}"
            )


if __name__ == "__main__":
    main()
