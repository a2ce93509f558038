"""Sluice end to end: the real `openai` SDK -> `sluice serve` -> two emulated vLLM replicas."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import urllib.request

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack.conftest import Stack

pytestmark = pytest.mark.timeout(120)

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about admission control."}]


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def _aclient(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_replicas_model_with_max_model_len(stack: Stack) -> None:
    status, body = stack.get_json("/v1/models")
    assert status == 200
    data = body["data"]
    assert isinstance(data, list)
    assert [m["id"] for m in data] == [stack.model]  # two replicas, one model, listed once
    assert data[0]["max_model_len"] > 0


def test_health_and_readiness(stack: Stack) -> None:
    assert stack.get_json("/healthz")[0] == 200
    assert stack.get_json("/readyz")[0] == 200


def test_sync_chat_non_streaming_reports_usage_and_request_id(stack: Stack) -> None:
    raw = _client(stack).chat.completions.with_raw_response.create(
        model=stack.model, messages=USER, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert re.fullmatch(r"[\w.-]{8,}", raw.headers["x-request-id"])
    completion = raw.parse()
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens > 0
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content


def test_sync_chat_streaming_without_usage_hides_the_usage_chunk(stack: Stack) -> None:
    chunks = list(
        _client(stack).chat.completions.create(
            model=stack.model, messages=USER, max_tokens=10, stream=True, extra_body={"ignore_eos": True}
        )
    )
    # Sluice asked the replica for usage; the client did not, so it must not see it.
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sync_chat_streaming_with_usage_passes_it_through(stack: Stack) -> None:
    chunks = list(
        _client(stack).chat.completions.create(
            model=stack.model,
            messages=USER,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 10
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_sync_completions_streaming_and_not(stack: Stack) -> None:
    client = _client(stack)
    plain = client.completions.create(
        model=stack.model, prompt="Once upon a time", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert plain.usage is not None
    assert plain.usage.completion_tokens == 7
    streamed = list(
        client.completions.create(
            model=stack.model,
            prompt="Once upon a time",
            max_tokens=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    assert all(c.usage is None for c in streamed)


async def test_async_clients_concurrently_streaming_and_not(stack: Stack) -> None:
    client = _aclient(stack)

    async def stream_one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    async def plain_one(i: int) -> int:
        done = await client.completions.create(
            model=stack.model, prompt=f"prompt {i}", max_tokens=16, extra_body={"ignore_eos": True}
        )
        assert done.usage is not None
        return done.usage.completion_tokens

    results = await asyncio.gather(*(stream_one(i) for i in range(8)), *(plain_one(i) for i in range(8)))
    await client.close()
    assert results == [16] * 16


def test_errors_reach_the_sdk_typed(stack: Stack) -> None:
    client = _client(stack)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=4)
    with pytest.raises(openai.BadRequestError):  # the replica's own 400: max_tokens over max_model_len
        client.chat.completions.create(model=stack.model, messages=USER, max_tokens=10_000_000)


def test_malformed_json_gets_openai_style_400(stack: Stack) -> None:
    req = urllib.request.Request(
        stack.base_url + "/v1/chat/completions",
        data=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=5)
    assert caught.value.code == 400
    body = json.loads(caught.value.read())
    assert set(body["error"]) >= {"message", "type", "code"}
    assert "Traceback" not in body["error"]["message"]
    assert caught.value.headers["x-request-id"]


def _abort_count(metrics: str) -> float:
    match = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.e+]+)', metrics)
    assert match, "the replica exposes request_success_total by finished_reason"
    return float(match.group(1))


def _running(metrics: str) -> float:
    match = re.search(r"vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)", metrics)
    assert match
    return float(match.group(1))


def test_client_disconnect_aborts_the_upstream_request(stack: Stack) -> None:
    """A client that hangs up mid-stream must free the replica: vLLM counts it as an abort."""
    before = {name: _abort_count(stack.replica_metrics(name)) for name in stack.replica_ports}
    body = json.dumps(
        {
            "model": stack.model,
            "messages": USER,
            "max_tokens": 4000,  # ~30 s of decoding: it can only end early by an abort
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    host, port = stack.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
    # The socket is closed here, mid-stream.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = {name: stack.replica_metrics(name) for name in stack.replica_ports}
        aborted = sum(_abort_count(m) - before[n] for n, m in metrics.items())
        if aborted >= 1 and all(_running(m) == 0 for m in metrics.values()):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the upstream request was not aborted: {metrics}")


def test_reload_under_traffic_loses_no_request(stack: Stack) -> None:
    client = _client(stack)
    failures: list[BaseException] = []
    done = 0
    stop = threading.Event()

    def traffic() -> None:
        nonlocal done
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model=stack.model, messages=USER, max_tokens=8, extra_body={"ignore_eos": True}
                )
                done += 1
            except BaseException as exc:  # any failure at all is the finding
                failures.append(exc)

    workers = [threading.Thread(target=traffic) for _ in range(4)]
    for w in workers:
        w.start()
    original = dict(stack.config)
    try:
        replicas = original["replicas"]
        assert isinstance(replicas, list)
        # Drop one replica, then bring it back, while requests flow.
        stack.write_config({**original, "replicas": replicas[:1]})
        _wait_for(lambda: _ready_replicas(stack) == {replicas[0]["name"]})
        stack.write_config({**original, "health": {"interval_s": 0.4, "timeout_s": 0.4}})
        _wait_for(lambda: _ready_replicas(stack) == {r["name"] for r in replicas})
    finally:
        stop.set()
        for w in workers:
            w.join(30)
        stack.write_config(original)
    assert not failures, failures[:3]
    assert done > 0


def _ready_replicas(stack: Stack) -> set[str]:
    _, body = stack.get_json("/readyz")
    replicas = body.get("replicas", [])
    assert isinstance(replicas, list)
    return {r["name"] for r in replicas if r.get("state") == "healthy"}


def _wait_for(predicate: object, timeout_s: float = 15.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail("condition not reached in time")


def _gc_collections(stack: Stack) -> dict[str, float]:
    """``python_gc_collections_total`` by generation, from the gateway's own ``/metrics``."""
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        sample.labels["generation"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "python_gc_collections"
        for sample in family.samples
    }


async def test_serving_leaves_the_cycle_collector_idle(stack: Stack) -> None:
    """`sluice serve` freezes its start-up objects and collects the young generation only every
    10,000 net allocations (``gateway.serve._quiet_gc``), and its requests make no cyclic garbage: 600
    requests run no full collection, which stops the event loop for ~50 ms without the freeze, and
    next to no young one (with CPython's default thresholds: 9)."""
    client = _aclient(stack)
    slots = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        async with slots:
            if i % 2:
                await client.completions.create(model=stack.model, prompt=f"prompt {i}", max_tokens=2)
            else:
                stream = await client.chat.completions.create(
                    model=stack.model, messages=USER, max_tokens=2, stream=True
                )
                async for _ in stream:
                    pass

    before = _gc_collections(stack)
    await asyncio.gather(*(one(i) for i in range(600)))
    after = _gc_collections(stack)
    await client.close()

    assert set(before) == {"0", "1", "2"}, before
    assert after["2"] - before["2"] == 0, (before, after)
    assert after["0"] - before["0"] <= 3, (before, after)
