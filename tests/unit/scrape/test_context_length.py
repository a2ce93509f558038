"""A replica's context length from TGI's ``/info`` and SGLang's ``/get_server_info``.

TGI's ``/v1/models`` has no ``max_model_len`` and SGLang's not always; their info endpoints do.
The bodies are the emulator's (built from TGI's ``Info`` struct and SGLang's server info) and the
shape of a real SGLang 2026 answer (``context_length`` null unless set, ``max_req_input_len``).
Against the emulated engines (real processes): the health checker's model cards get the length.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from gateway.api.responses import ModelCard, parse_models
from gateway.replicas.dialects.info import context_length_from_info, fetch_context_length, fill_context_length
from simulator import sglang, tgi
from tests.support.procs import Proc, free_port, python_module


@pytest.mark.parametrize(
    ("engine", "body", "expected"),
    [
        pytest.param(
            "tgi",
            tgi.info_body(
                model_id="m", max_concurrent_requests=128, max_input_tokens=4095, max_total_tokens=4096
            ),
            4096,
            id="tgi-total",
        ),
        pytest.param("tgi", {"max_input_tokens": 1023}, 1024, id="tgi-input-only"),
        pytest.param("tgi", {"max_input_length": 1023, "max_total_tokens": None}, 1024, id="tgi-v1-input"),
        pytest.param(
            "sglang",
            sglang.server_info_body(
                model_path="m",
                served_model_name="m",
                max_running_requests=64,
                chunked_prefill_size=8192,
                page_size=1,
                context_length=8192,
                tp_size=1,
                kv_capacity_tokens=200_000,
                last_gen_throughput=0.0,
            ),
            8192,
            id="sglang-context-length",
        ),
        # A real SGLang answer (qwen2.5-0.5b): context_length is a server argument, null unless set.
        pytest.param(
            "sglang",
            {"context_length": None, "max_total_num_tokens": 20480, "max_req_input_len": 20474},
            20475,
            id="sglang-real-null-context",
        ),
        pytest.param("sglang", {"max_total_num_tokens": 20480}, 20480, id="sglang-pool-only"),
        pytest.param("tgi", {"router": "text-generation-router"}, None, id="tgi-silent"),
        pytest.param("sglang", {"context_length": 0, "max_req_input_len": True}, None, id="sglang-garbage"),
        pytest.param("tgi", ["not", "an", "object"], None, id="not-an-object"),
        pytest.param("vllm", {"max_total_tokens": 4096}, None, id="vllm-has-no-info"),
    ],
)
def test_context_length_from_info(engine: str, body: Any, expected: int | None) -> None:
    assert context_length_from_info(engine, body) == expected


def test_tgi_models_list_has_no_length_to_read() -> None:
    (card,) = parse_models(tgi.models_body("bigscience/bloom-560m")).values()
    assert card.max_model_len is None


@pytest.fixture(scope="module")
def emulators() -> Iterator[dict[str, str]]:
    """One emulator process per engine, by engine name -> base URL."""
    procs: dict[str, tuple[Proc, str]] = {}
    try:
        for engine in ("vllm", "tgi", "sglang"):
            port = free_port()
            args = python_module(
                "simulator", "--profile", "llama3-8b-h100", "--port", str(port), "--engine", engine
            )
            procs[engine] = (Proc(args, name=f"emulator-{engine}"), f"http://127.0.0.1:{port}")
        for proc, url in procs.values():
            proc.wait_http(url + "/health")
        yield {engine: url for engine, (_, url) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.stop()


async def _cards(session: aiohttp.ClientSession, url: str) -> dict[str, ModelCard]:
    async with session.get(url + "/v1/models") as resp:
        return parse_models(await resp.json())


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["tgi", "sglang", None])
async def test_the_emulated_engines_tell_their_context_length(
    emulators: dict[str, str], engine: str | None
) -> None:
    """Each emulator serves the profile's max_model_len (8192); an undetected engine (``None``)
    is probed at both info endpoints."""
    async with aiohttp.ClientSession() as session:
        for name in ("tgi", "sglang") if engine is None else (engine,):
            assert await fetch_context_length(session, emulators[name], engine, 5.0) == 8192
        assert await fetch_context_length(session, emulators["vllm"], None, 5.0) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_tgi_card_gets_the_length_from_info(emulators: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        cards = await _cards(session, emulators["tgi"])
        assert [c.max_model_len for c in cards.values()] == [None], "TGI's /v1/models has no length"
        filled = await fill_context_length(session, emulators["tgi"], "tgi", cards, 5.0)
        assert [c.max_model_len for c in filled.values()] == [8192]
        assert [c.card for c in filled.values()] == [c.card for c in cards.values()], "passed on as is"
        # vLLM's cards already have it: no request, nothing changed.
        vllm = await _cards(session, emulators["vllm"])
        assert await fill_context_length(session, emulators["vllm"], "vllm", vllm, 5.0) == vllm
