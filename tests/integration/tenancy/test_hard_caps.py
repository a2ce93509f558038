"""A tenant's token budget is a hard cap whatever its requests say.

Three ``sluice serve`` processes share one tenant's bucket in a real ``redis-server``, in front of
an emulated vLLM replica whose model always talks long (every answer left to stop on its own is
1,000 tokens; the gateway predicts 256). One tenant sends five kinds of request at once, three
streamed:

* ``ignore_eos`` with ``max_tokens: 400``: sure to produce 400 tokens, so 400 are reserved;
* ``ignore_eos`` without ``max_tokens`` (a chat completion, whose default cap is the context
  left): sure to produce the whole context, more than the bucket can ever hold (refused, not
  retryable);
* no ``ignore_eos``, ``max_tokens: 1000``: reserved at the prediction, then outrunning it, so
  charged ahead step by step and stopped with an error event when the bucket refuses a step;

and two answered whole (not streamed), which cannot be stopped part-way, so reserve their whole
output cap:

* ``max_tokens: 600``: 600 reserved, and 600 produced (the model talks longer);
* a chat without ``max_tokens``: the gateway sets the largest the bucket holds
  (``x-sluice-max-tokens-set``), under the 1,000 the model would talk, so it ends at that cap
  (``finish_reason: "length"``).

What the clients received (prompt + 2 x output tokens: the pinned weights) in the window stays
within the bound ``docs/tenants.md`` states: the bucket's capacity, its refill over the window,
one output token per stream (the one a stream stopped, or ending, produced past its cover) and
the prompt estimate's error (0 for token ids; for a chat's text at most its prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.api.openai import MAX_TOKENS_SET_HEADER
from tests.integration.tenancy.fleet import KEY, PROMPT_TOKENS, emulator, gateway_config, gateways, model_of
from tests.support.procs import ROOT, free_port
from tests.support.redis import RedisNotInstalled, redis_server

pytestmark = pytest.mark.timeout(240)

GATEWAYS = 3
#: The capped tenant's budget: 100 weighted tokens a second, 2,000 at once.
TOKENS_PER_MINUTE = 6000.0
TOKEN_BURST = 2000.0
OUTPUT_WEIGHT = 2.0
#: Every answer left to stop on its own is this long (the emulator's lognormal with sigma 0).
TALK_TOKENS = 1000
DURATION_S = 5.0
WORKERS = 12
ANSWER_MAX_TOKENS = 600
#: (route, body fields) of each kind of request.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "ignore_eos": (
        "/v1/completions",
        {"prompt": [11] * PROMPT_TOKENS, "ignore_eos": True, "max_tokens": 400},
    ),
    "ignore_eos_uncapped": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
    ),
    "outruns": ("/v1/completions", {"prompt": [11] * PROMPT_TOKENS, "max_tokens": TALK_TOKENS}),
    "answer": ("/v1/completions", {"prompt": [11] * PROMPT_TOKENS, "max_tokens": ANSWER_MAX_TOKENS}),
    "answer_uncapped": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
}
#: The kinds answered whole, not streamed.
ANSWERS = frozenset({"answer", "answer_uncapped"})


@pytest.fixture(scope="module")
def long_talker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    profile = yaml.safe_load((ROOT / "config" / "profiles" / "llama3-8b-h100.yaml").read_text())
    profile["output_lengths"] = {"distribution": "lognormal", "median_tokens": TALK_TOKENS, "sigma": 0.0}
    path = tmp_path_factory.mktemp("profile") / "long-talker.yaml"
    path.write_text(yaml.safe_dump(profile))
    with emulator(seed=7, profile=str(path)) as url:
        yield url


@dataclass
class Streams:
    """What the clients saw. ``consumed``: weighted tokens received (usage when the stream
    completed, else the prompt and the token chunks received)."""

    #: Each kind's prompt in tokens.
    prompts: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0
    ended_at: float = 0.0
    consumed: float = 0.0
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    #: Streams ended by an error event, by kind and error code.
    stopped: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Output tokens of completed streams and answers, by kind.
    completed: dict[str, list[int]] = field(default_factory=dict)
    #: Answers without ``max_tokens``: (the cap the gateway set, output tokens, finish reason).
    capped: list[tuple[int, int, str]] = field(default_factory=list)
    #: Prompt tokens of the answered chats (their prompts are estimated from text).
    estimated_prompts: int = 0
    #: Set once the first request has its answer's status.
    answered: asyncio.Event = field(default_factory=asyncio.Event)


async def prompt_tokens(replica: str, model: str) -> dict[str, int]:
    """Each kind's prompt in tokens, as the replica itself counts it (asked directly)."""
    sizes = {}
    async with aiohttp.ClientSession() as session:
        for kind, (route, fields) in KINDS.items():
            body = {**fields, "model": model, "max_tokens": 1, "ignore_eos": False}
            async with session.post(replica + route, json=body) as resp:
                sizes[kind] = int((await resp.json())["usage"]["prompt_tokens"])
    return sizes


async def one_stream(session: aiohttp.ClientSession, url: str, model: str, kind: str, seen: Streams) -> int:
    route, fields = KINDS[kind]
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **fields}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with session.post(url + route, json=body, headers=headers) as resp:
        seen.statuses[(kind, resp.status)] += 1
        seen.answered.set()
        if resp.status != 200:
            await resp.read()
            return resp.status
        tokens, usage, error = 0, None, None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: ") :])
            if "error" in payload:
                error = payload["error"]
            elif payload.get("usage"):
                usage = payload["usage"]
            elif payload.get("choices"):
                tokens += 1
    if usage is not None:
        seen.consumed += usage["prompt_tokens"] + OUTPUT_WEIGHT * usage["completion_tokens"]
        seen.completed.setdefault(kind, []).append(usage["completion_tokens"])
    else:
        # Every chunk with a choice counted as a token (a chat's role-only first one too).
        seen.consumed += seen.prompts[kind] + OUTPUT_WEIGHT * tokens
        seen.stopped[(kind, str((error or {}).get("code")))] += 1
    return 200


async def one_answer(session: aiohttp.ClientSession, url: str, model: str, kind: str, seen: Streams) -> int:
    route, fields = KINDS[kind]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with session.post(url + route, json={"model": model, **fields}, headers=headers) as resp:
        seen.statuses[(kind, resp.status)] += 1
        seen.answered.set()
        if resp.status != 200:
            await resp.read()
            return resp.status
        answer = await resp.json()
        cap = resp.headers.get(MAX_TOKENS_SET_HEADER)
    usage = answer["usage"]
    seen.consumed += usage["prompt_tokens"] + OUTPUT_WEIGHT * usage["completion_tokens"]
    seen.completed.setdefault(kind, []).append(usage["completion_tokens"])
    if route == "/v1/chat/completions":
        seen.estimated_prompts += usage["prompt_tokens"]
    if "max_tokens" not in fields:
        finish = answer["choices"][0]["finish_reason"]
        seen.capped.append((-1 if cap is None else int(cap), usage["completion_tokens"], finish))
    return 200


async def drive(
    urls: list[str], model: str, prompts: dict[str, int], kinds: list[str], workers: int, lead: str | None
) -> Streams:
    """``workers`` clients for ``DURATION_S``, round-robin over ``urls`` and ``kinds``. The clients
    of kind ``lead`` send first; the others start once one of them has its answer's status (so
    that which kind reaches the full bucket first is set, not left to the scheduler)."""
    seen = Streams(prompts=prompts)
    timeout = aiohttp.ClientTimeout(total=120.0)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=workers), timeout=timeout
    ) as session:
        seen.started_at = time.monotonic()
        stop_at = seen.started_at + DURATION_S

        async def worker(index: int) -> None:
            url, kind = urls[index % len(urls)], kinds[index % len(kinds)]
            one = one_answer if kind in ANSWERS else one_stream
            if lead is not None and kind != lead:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(seen.answered.wait(), stop_at - time.monotonic())
            while time.monotonic() < stop_at:
                if await one(session, url, model, kind, seen) != 200:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(worker(i) for i in range(workers)))
        seen.ended_at = time.monotonic()
    return seen


async def run(
    tmp_path: Path, replica: str, kinds: list[str], workers: int, lead: str | None = None
) -> Streams:
    """Three gateways on one ``redis-server``, one tenant, ``workers`` clients sending ``kinds``
    (those of kind ``lead`` first)."""
    tenant_limits = {"tokens_per_minute": TOKENS_PER_MINUTE, "token_burst": TOKEN_BURST}
    try:
        with redis_server(name="redis-hard-caps") as server:
            # fail_closed: a slow Redis call is a 503, never a local bucket blurring the shared one.
            limits = {
                "backend": "redis",
                "redis": {"url": server.url, "timeout_s": 2.0},
                "on_storage_error": "fail_closed",
                "expected_gateways": GATEWAYS,
            }
            configs = [
                gateway_config(replica, free_port(), limits=limits, tenant_limits=tenant_limits)
                for _ in range(GATEWAYS)
            ]
            with gateways(tmp_path, configs) as fleet:
                urls = [g.url for g in fleet]
                model = await model_of(urls[0])
                seen = await drive(urls, model, await prompt_tokens(replica, model), kinds, workers, lead)
                assert all(g.alive() for g in fleet)
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))
    return seen


def within_the_bound(seen: Streams) -> None:
    """What the clients received stays within docs/tenants.md's bound (see the module)."""
    window = seen.ended_at - seen.started_at
    streams = sum(n for (kind, status), n in seen.statuses.items() if status == 200 and kind not in ANSWERS)
    bound = TOKEN_BURST + TOKENS_PER_MINUTE / 60.0 * window + OUTPUT_WEIGHT * streams + seen.estimated_prompts
    assert {status for _, status in seen.statuses} <= {200, 429}, seen.statuses
    assert seen.consumed <= bound, f"consumed {seen.consumed} > {bound} over {window:.1f} s ({seen})"
    # An answer without max_tokens got the largest the bucket holds (under the model's 1,000
    # tokens), named in its header, and ended there.
    assert all(out == cap and finish == "length" for cap, out, finish in seen.capped), seen.capped
    assert all(TOKEN_BURST / 2 - 50 <= cap < TALK_TOKENS for cap, _, _ in seen.capped), seen.capped


async def test_streams_and_answers_on_three_gateways_stay_within_the_bound(
    tmp_path: Path, long_talker: str
) -> None:
    # The stream that outruns its reservation goes first: an answer without max_tokens reserves the
    # whole bucket, and sent first it would leave less than a stream's reservation refilled in the
    # window, so no stream would be admitted at all.
    seen = await run(tmp_path, long_talker, list(KINDS), WORKERS, lead="outruns")

    within_the_bound(seen)
    # Streams were stopped by the budget only; a stream that outran its reservation was charged
    # ahead: stopped, or run to its end (past the 256 tokens reserved) within the bound.
    assert {code for _, code in seen.stopped} <= {"rate_limit_exceeded"}, seen.stopped
    assert set(seen.completed.get("outruns", [])) <= {TALK_TOKENS}, seen.completed
    assert seen.stopped[("outruns", "rate_limit_exceeded")] + len(seen.completed.get("outruns", [])) >= 1, (
        seen
    )
    # An ignore_eos stream that was admitted was reserved whole: it ran to its cap, never stopped.
    assert set(seen.completed.get("ignore_eos", [])) <= {400}, seen.completed
    assert not any(kind == "ignore_eos" for kind, _ in seen.stopped), seen.stopped
    # An answer reserved its whole cap and ran to it.
    assert set(seen.completed.get("answer", [])) <= {ANSWER_MAX_TOKENS}, seen.completed
    # The clients asked for far more than the bound: the budget, not the load, stopped them.
    assert seen.statuses[("ignore_eos_uncapped", 429)] + seen.statuses[("ignore_eos", 429)] >= 1, seen


async def test_chats_without_max_tokens_on_three_gateways_stay_within_the_bound(
    tmp_path: Path, long_talker: str
) -> None:
    """Answers alone: the first reaches a full bucket, so some are served, each at its cap."""
    seen = await run(tmp_path, long_talker, ["answer_uncapped"], WORKERS // 2)

    within_the_bound(seen)
    assert len(seen.capped) >= 1, seen
    assert seen.statuses[("answer_uncapped", 429)] >= 1, seen
