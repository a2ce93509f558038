"""``--engine tgi|sglang``: info endpoints, TGI's native API and its overload behaviour, over HTTP.

Each test runs the emulator as a real aiohttp server on a free port. The expected shapes are
TGI's (``router/src/lib.rs`` / ``server.rs`` / ``docs/openapi.json``, v3) and SGLang's
``/get_server_info`` fields as ``shared/reference/backend-metrics.md`` §2.2, §2.3 and §3.3 list
them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from pytest_aiohttp import AiohttpServer

from gateway.cli import main as cli_main
from gateway.config.settings import Settings
from gateway.replicas.config import EmulatorSettings
from gateway.replicas.emulators import emulator_command
from simulator import tgi
from simulator.cli import _parser
from simulator.profile import load_profile
from simulator.server import build_app
from tests.support.procs import free_port, running

MAX_MODEL_LEN = 1024
WAIT_S = 30.0


def _profile() -> Any:
    return load_profile("llama3-8b-h100").with_engine(max_model_len=MAX_MODEL_LEN)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _server(aiohttp_server: AiohttpServer, engine: str, **kwargs: Any) -> Any:
    return await aiohttp_server(build_app(_profile(), seed=1, engine=engine, **kwargs))  # type: ignore[arg-type]


def _events(raw: str) -> list[Any]:
    """The JSON payloads of an SSE body; every event must be ``data: ...`` and a blank line."""
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    payloads = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block
        payloads.append(json.loads(block[len("data: ") :]))
    return payloads


# -- TGI -------------------------------------------------------------------------------------------


async def test_tgi_info_has_the_info_struct(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi", max_concurrent_requests=7)
    async with session.get(server.make_url("/info")) as resp:
        assert resp.status == 200
        info = await resp.json()

    assert list(info) == [
        "model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
        "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
        "max_client_batch_size", "router", "version", "sha", "docker_label",
    ]  # fmt: skip
    assert info["router"] == "text-generation-router"
    assert info["max_concurrent_requests"] == 7
    assert info["max_total_tokens"] == MAX_MODEL_LEN
    assert info["max_input_tokens"] == MAX_MODEL_LEN - 1
    # Gone from /info since v2.3: the batch limits.
    assert not {"max_batch_total_tokens", "max_batch_size", "max_batch_prefill_tokens"} & set(info)


async def test_tgi_generate_body_and_headers(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi")
    body = {
        "inputs": "What is Deep Learning?",
        "parameters": {"max_new_tokens": 6, "details": True, "seed": 3},
    }
    async with session.post(server.make_url("/generate"), json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        headers = resp.headers
        payload = await resp.json()

    details = payload["details"]
    assert list(payload) == ["generated_text", "details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert details["finish_reason"] in {"length", "eos_token"}
    assert details["seed"] == 3
    assert details["generated_tokens"] == len(details["tokens"]) >= 1
    assert all(list(t) == ["id", "text", "logprob", "special"] for t in details["tokens"])
    assert payload["generated_text"] == "".join(t["text"] for t in details["tokens"])
    assert headers["x-generated-tokens"] == str(details["generated_tokens"])
    assert int(headers["x-prompt-tokens"]) >= 1
    assert headers["x-compute-type"] == tgi.COMPUTE_TYPE
    assert headers["x-compute-characters"] == str(len(body["inputs"]))
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(headers[name]) >= 0
    assert float(headers["x-compute-time"]) > 0


async def test_tgi_generate_without_details_has_only_text(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi")
    async with session.post(
        server.make_url("/generate"), json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}
    ) as r:
        assert r.status == 200
        assert list(await r.json()) == ["generated_text"]


async def test_tgi_generate_stream_events(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi")
    body = {"inputs": "Tell me a story", "parameters": {"max_new_tokens": 5, "details": True}}
    async with session.post(server.make_url("/generate_stream"), json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Accel-Buffering"] == "no"
        events = _events(await resp.text())

    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    for event in events:
        assert list(event) == ["index", "token", "generated_text", "details"]
        assert list(event["token"]) == ["id", "text", "logprob", "special"]
        assert event["token"]["special"] is False
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert list(last["details"]) == ["finish_reason", "generated_tokens", "seed", "input_length"]
    assert last["details"]["generated_tokens"] == len(events)
    assert last["details"]["input_length"] >= 1
    assert last["details"]["seed"] is None


async def test_tgi_stream_without_details_ends_with_text_only(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi")
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
    async with session.post(server.make_url("/generate_stream"), json=body) as resp:
        events = _events(await resp.text())
    assert events[-1]["generated_text"] is not None
    assert events[-1]["details"] is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param({"inputs": ""}, "`inputs` cannot be empty", id="empty"),
        pytest.param(
            {"inputs": "a b c", "parameters": {"max_new_tokens": 0}},
            "`max_new_tokens` must be strictly positive",
            id="zero-new-tokens",
        ),
        pytest.param(
            {"inputs": "a b c", "parameters": {"max_new_tokens": MAX_MODEL_LEN}},
            f"`inputs` tokens + `max_new_tokens` must be <= {MAX_MODEL_LEN}. Given: 4 `inputs` tokens and "
            f"{MAX_MODEL_LEN} `max_new_tokens`",
            id="total-too-long",
        ),
    ],
)
async def test_tgi_validation_is_422(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession, body: dict[str, Any], message: str
) -> None:
    server = await _server(aiohttp_server, "tgi")
    async with session.post(server.make_url("/generate"), json=body) as resp:
        assert resp.status == 422
        assert await resp.json() == {"error": message, "error_type": "validation"}


async def _hold_streams(session: aiohttp.ClientSession, url: str, n: int) -> list[aiohttp.ClientResponse]:
    """Open ``n`` long streams and wait until each has its first token: their permits are taken."""
    responses = []
    for i in range(n):
        body = {"prompt": f"hold {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        resp = await session.post(f"{url}/v1/completions", json=body)
        assert resp.status == 200
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S)
        responses.append(resp)
    return responses


async def test_tgi_refuses_past_max_concurrent_requests(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi", max_concurrent_requests=2)
    url = str(server.make_url("/")).rstrip("/")
    holders = await _hold_streams(session, url, 2)
    try:
        async with session.post(f"{url}/generate", json={"inputs": "one more"}) as resp:
            assert resp.status == 429
            assert await resp.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        async with session.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 429
            assert await resp.json() == tgi.OVERLOADED_BODY
        # A stream has answered 200 before it asks for a permit: the refusal is its one event.
        async with session.post(f"{url}/generate_stream", json={"inputs": "x"}) as resp:
            assert resp.status == 200
            assert _events(await resp.text()) == [tgi.OVERLOADED_BODY]
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
    finally:
        for holder in holders:
            holder.close()
    assert 'tgi_request_failure{err="overloaded"} 3\n' in text
    assert "tgi_request_count 5\n" in text


async def test_tgi_permit_is_given_back_when_a_request_ends(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi", max_concurrent_requests=1)
    for _ in range(3):  # one at a time always fits
        async with session.post(
            server.make_url("/generate"), json={"inputs": "x", "parameters": {"max_new_tokens": 2}}
        ) as r:
            assert r.status == 200


async def test_vllm_engine_never_refuses(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "vllm", max_concurrent_requests=1)
    url = str(server.make_url("/")).rstrip("/")
    holders = await _hold_streams(session, url, 2)
    try:
        async with session.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 200
        async with session.get(f"{url}/info") as resp:
            assert resp.status == 404  # no TGI routes on a vLLM emulator
    finally:
        for holder in holders:
            holder.close()


# -- SGLang ----------------------------------------------------------------------------------------


async def test_sglang_server_info_and_model_info(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "sglang")
    profile = _profile()
    async with session.get(server.make_url("/get_server_info")) as resp:
        assert resp.status == 200
        info = await resp.json()
    async with session.get(server.make_url("/server_info")) as resp:
        assert await resp.json() == info
    async with session.get(server.make_url("/get_model_info")) as resp:
        model = await resp.json()
    async with session.get(server.make_url("/health_generate")) as resp:
        assert resp.status == 200

    for key in (
        "model_path", "served_model_name", "max_running_requests", "max_queued_requests",
        "max_total_tokens", "chunked_prefill_size", "max_prefill_tokens", "page_size", "context_length",
        "schedule_policy", "mem_fraction_static", "tp_size", "dp_size", "max_total_num_tokens",
        "max_req_input_len", "internal_states", "version",
    ):  # fmt: skip
        assert key in info, key
    assert info["max_total_num_tokens"] == profile.kv_cache_size_tokens
    assert info["max_running_requests"] == profile.engine.max_num_seqs
    assert info["chunked_prefill_size"] == profile.engine.max_num_batched_tokens
    assert info["context_length"] == MAX_MODEL_LEN
    state = info["internal_states"][0]
    assert state["memory_usage"]["token_capacity"] == profile.kv_cache_size_tokens
    assert state["effective_max_running_requests_per_dp"] == profile.engine.max_num_seqs
    assert set(model) == {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    }


# -- configuration and command line -----------------------------------------------------------------


def test_cli_takes_engine_and_limit() -> None:
    args = _parser().parse_args(["--profile", "p", "--engine", "tgi", "--max-concurrent-requests", "9"])
    assert (args.engine, args.max_concurrent_requests) == ("tgi", 9)
    assert _parser().parse_args(["--profile", "p"]).engine == "vllm"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--profile", "p", "--engine", "trtllm"])


def test_emulator_settings_engine_reaches_command_and_backend() -> None:
    settings = Settings.model_validate({"emulators": [{"name": "e", "port": 8123, "engine": "sglang"}]})
    emulator = settings.emulators[0]
    command = emulator_command(emulator)
    assert command[command.index("--engine") + 1] == "sglang"
    assert settings.all_replicas()[0].backend == "sglang"
    default = EmulatorSettings.model_validate({"name": "v", "port": 8124})
    assert "--engine" not in emulator_command(default)


def test_sluice_sim_passes_engine_options_through(capfd: pytest.CaptureFixture[str]) -> None:
    """`sluice sim --profile ... --engine ...`: options before any positional reach the emulator."""
    assert cli_main(["sim", "--profile", "no-such-profile", "--engine", "tgi"]) == 2
    assert "cannot load profile 'no-such-profile'" in capfd.readouterr().err


def test_sluice_sim_serves_tgi_info_as_a_process() -> None:
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "sim", "--profile", "llama3-8b-h100"]
    args += ["--port", str(port), "--engine", "tgi", "--max-concurrent-requests", "3"]
    with (
        running(args, f"http://127.0.0.1:{port}/health", name="sim-tgi"),
        urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=10) as resp,
    ):
        info = json.load(resp)
    assert info["max_concurrent_requests"] == 3
    assert info["router"] == "text-generation-router"


async def test_tgi_body_axum_cannot_read_is_refused_before_counting(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi")
    async with session.post(
        server.make_url("/generate"), data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        assert (await r.text()).startswith("Failed to parse the request body as JSON")
    async with session.post(server.make_url("/generate_stream"), json={"prompt": "no inputs"}) as r:
        assert r.status == 422
        assert r.content_type == "text/plain"
        assert "missing field `inputs`" in await r.text()
    async with session.get(server.make_url("/metrics")) as r:
        assert "tgi_request_count" not in await r.text()


async def test_tgi_compat_route_follows_stream(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "tgi")
    body: dict[str, Any] = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
    async with session.post(server.make_url("/"), json=body) as r:
        assert r.status == 200
        assert list(await r.json()) == ["generated_text"]
    async with session.post(server.make_url("/"), json={**body, "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = _events(await r.text())
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)


async def test_sglang_native_generate_whole_and_streamed(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    server = await _server(aiohttp_server, "sglang")
    body: dict[str, Any] = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
    }
    async with session.post(server.make_url("/generate"), json=body) as r:
        assert r.status == 200
        whole = await r.json()
    meta = whole["meta_info"]
    assert set(meta) == {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"}
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8
    assert len(whole["text"].split()) == 8

    async with session.post(server.make_url("/generate"), json={**body, "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    assert raw.endswith("data: [DONE]\n\n")
    events = _events(raw.removesuffix("data: [DONE]\n\n"))
    texts = [e["text"] for e in events]
    # The text so far in every event (SGLang's default), growing to the whole output.
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert events[-1]["text"] == whole["text"]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
