"""``sluice sim --engine tgi|sglang``: its /metrics against the engine's own names, and what
Sluice's dialect for that engine reads from it.

SGLang is checked against the one real SGLang scrape in public, the ~v0.4 docs example
(``tests/data/metrics/sglang-v0.4-docs-production_metrics.txt``): names, types, labels, buckets.
TGI has no real scrape anywhere public (``shared/reference/backend-metrics.md`` §6), so it is
checked against the reference's TGI table (§2.1, read in TGI's router source), copied below as
``TGI_REFERENCE``. Then each emulator, under real traffic, is scraped twice and read by the
matching dialect: every quantity that engine offers must land in the snapshot.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pytest_aiohttp import AiohttpServer

from gateway.replicas.dialects import detect, get_dialect
from gateway.replicas.exposition import parse_exposition
from gateway.replicas.scrape import SnapshotBuilder
from simulator.profile import load_profile
from simulator.server import build_app

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
SGLANG_SAMPLE = DATA / "sglang-v0.4-docs-production_metrics.txt"
MAX_MODEL_LEN = 1024

#: The reference's TGI metric table (§2.1): family -> (type, label names). prometheus_client's
#: parser names counter families without a ``_total`` it then adds to each sample.
TGI_REFERENCE: dict[str, tuple[str, frozenset[str]]] = {
    "tgi_queue_size": ("gauge", frozenset()),
    "tgi_batch_current_size": ("gauge", frozenset()),
    "tgi_batch_current_max_tokens": ("gauge", frozenset()),
    "tgi_batch_max_total_tokens": ("gauge", frozenset()),
    "tgi_batch_next_size": ("histogram", frozenset()),
    "tgi_batch_concat": ("counter", frozenset({"reason"})),
    "tgi_batch_inference_count": ("counter", frozenset({"method"})),
    "tgi_batch_inference_success": ("counter", frozenset({"method"})),
    "tgi_batch_inference_failure": ("counter", frozenset({"method"})),
    "tgi_batch_forward_duration": ("histogram", frozenset({"method"})),
    "tgi_batch_decode_duration": ("histogram", frozenset({"method"})),
    "tgi_batch_filter_duration": ("histogram", frozenset({"method"})),
    "tgi_batch_concat_duration": ("histogram", frozenset({"method"})),
    "tgi_batch_inference_duration": ("histogram", frozenset({"method"})),
    "tgi_request_count": ("counter", frozenset()),
    "tgi_request_success": ("counter", frozenset()),
    "tgi_request_failure": ("counter", frozenset({"err"})),
    "tgi_request_duration": ("histogram", frozenset()),
    "tgi_request_validation_duration": ("histogram", frozenset()),
    "tgi_request_queue_duration": ("histogram", frozenset()),
    "tgi_request_inference_duration": ("histogram", frozenset()),
    "tgi_request_mean_time_per_token_duration": ("histogram", frozenset()),
    "tgi_request_input_length": ("histogram", frozenset()),
    "tgi_request_max_new_tokens": ("histogram", frozenset()),
    "tgi_request_generated_tokens": ("histogram", frozenset()),
    "tgi_request_skipped_tokens": ("histogram", frozenset()),
}
#: Reference families the TGI emulator leaves out, each with its reason.
TGI_EXCLUDED = {
    "tgi_batch_concat": "the emulated engine merges new requests into its step; no separate concat",
    "tgi_batch_concat_duration": "no separate concat step",
    "tgi_batch_decode_duration": "no detokenizer: the step is one cost-model time",
    "tgi_batch_filter_duration": "no batch filtering step",
    "tgi_batch_inference_failure": "emulated steps never fail",
    "tgi_request_skipped_tokens": "no speculative decoding",
}
#: Real SGLang families the SGLang emulator leaves out, and the ones it adds.
SGLANG_EXCLUDED = {
    "sglang:func_latency_seconds": "latency of decorated Python functions: none in the emulator"
}
SGLANG_ADDED = {"sglang:max_total_num_tokens": "KV capacity, a startup gauge since 2024 (reference §3.2)"}


def families(text: str, prefix: str) -> dict[str, Metric]:
    return {
        f.name: f
        for f in text_string_to_metric_families(text)
        if f.name.startswith(prefix) and not f.name.endswith("_created")
    }


def label_names(family: Metric) -> frozenset[str]:
    return frozenset(k for s in family.samples for k in s.labels if k != "le")


def bounds(family: Metric, **where: str) -> list[float]:
    return [
        float(s.labels["le"])
        for s in family.samples
        if s.name.endswith("_bucket") and all(s.labels.get(k) == v for k, v in where.items())
    ]


async def _traffic(session: aiohttp.ClientSession, url: str, n: int = 6, max_tokens: int = 12) -> None:
    """``n`` concurrent completions of exactly ``max_tokens`` tokens (``ignore_eos``)."""

    async def one(i: int) -> None:
        body = {"prompt": f"request number {i} " * 20, "max_tokens": max_tokens, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200

    await asyncio.gather(*(one(i) for i in range(n)))


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def _emulator(aiohttp_server: AiohttpServer, engine: str) -> str:
    profile = load_profile("llama3-8b-h100").with_engine(max_model_len=MAX_MODEL_LEN)
    server = await aiohttp_server(build_app(profile, seed=2, engine=engine))  # type: ignore[arg-type]
    return str(server.make_url("/")).rstrip("/")


# -- TGI -------------------------------------------------------------------------------------------


@pytest.fixture
async def tgi_texts(aiohttp_server: AiohttpServer) -> tuple[str, str]:
    url = await _emulator(aiohttp_server, "tgi")
    async with aiohttp.ClientSession() as session:
        await _traffic(session, url, n=2)
        # One refused request makes tgi_request_failure appear, as only recorded series exist.
        async with session.post(f"{url}/generate", json={"inputs": ""}) as resp:
            assert resp.status == 422
        before = await _scrape(session, url)
        await _traffic(session, url)
        return before, await _scrape(session, url)


def test_tgi_exposition_follows_the_reference(tgi_texts: tuple[str, str]) -> None:
    emulated = families(tgi_texts[1], "tgi_")
    expected = set(TGI_REFERENCE) - set(TGI_EXCLUDED)

    assert sorted(expected - set(emulated)) == []
    assert sorted(set(emulated) - set(TGI_REFERENCE)) == []
    for name, family in emulated.items():
        assert (family.type, label_names(family)) == TGI_REFERENCE[name], name


def test_tgi_counters_have_no_total_and_no_help(tgi_texts: tuple[str, str]) -> None:
    text = tgi_texts[1]
    assert "\ntgi_request_count " in text
    assert [line for line in text.splitlines() if "_total " in line or "_total{" in line] == []
    assert "# HELP" not in text
    assert 'tgi_request_failure{err="validation"} 1\n' in text


def test_tgi_buckets_follow_the_router(tgi_texts: tuple[str, str]) -> None:
    emulated = families(tgi_texts[1], "tgi_")
    geometric = [0.0001 * 1.5**k for k in range(1, 36)]
    assert bounds(emulated["tgi_request_duration"])[:-1] == pytest.approx(geometric)
    assert bounds(emulated["tgi_batch_forward_duration"], method="decode")[:-1] == pytest.approx(geometric)
    assert bounds(emulated["tgi_request_input_length"])[:-1] == pytest.approx(
        [(MAX_MODEL_LEN - 1) / 100 * i for i in range(1, 101)]
    )
    assert bounds(emulated["tgi_request_generated_tokens"])[:-1] == pytest.approx(
        [MAX_MODEL_LEN / 100 * i for i in range(1, 101)]
    )
    assert bounds(emulated["tgi_batch_next_size"])[:-1] == [float(i) for i in range(1, 1025)]


def test_tgi_dialect_reads_a_complete_snapshot(tgi_texts: tuple[str, str]) -> None:
    before, after = (parse_exposition(t) for t in tgi_texts)
    assert detect(after) == "tgi"
    builder = SnapshotBuilder("tgi", get_dialect("tgi"))
    builder.observe(before, 0.0)
    snap = builder.observe(after, 1.0)

    assert not snap.stale
    assert snap.kv_capacity_tokens == load_profile("llama3-8b-h100").kv_cache_size_tokens
    for field in ("num_running", "num_waiting", "kv_cache_usage"):
        assert getattr(snap, field) is not None, field
    # Six requests of exactly 12 tokens each between the scrapes, one second apart on this clock.
    assert snap.generation_tokens_per_s == pytest.approx(6 * 12)
    assert snap.requests_finished_per_s == pytest.approx(6)
    for field in (
        "prompt_tokens_per_s", "steps_per_s", "step_time_mean_s", "decode_step_time_mean_s",
        "prefill_step_time_mean_s", "decode_steps_per_s", "itl_mean_s", "queue_time_mean_s", "e2e_mean_s",
        "mean_prompt_tokens_per_request", "mean_generation_tokens_per_request",
    ):  # fmt: skip
        value = getattr(snap, field)
        assert value is not None, field
        assert value > 0, field
    assert snap.admission_rejections_per_s is None  # no 429 yet: the series does not exist
    assert snap.decode_step_time_mean_s == snap.itl_mean_s
    assert snap.steps_per_s is not None
    assert snap.decode_steps_per_s is not None
    assert snap.steps_per_s > snap.decode_steps_per_s


# -- SGLang ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_real() -> dict[str, Metric]:
    return families(SGLANG_SAMPLE.read_text(), "sglang:")


@pytest.fixture
async def sglang_texts(aiohttp_server: AiohttpServer) -> tuple[str, str]:
    url = await _emulator(aiohttp_server, "sglang")
    async with aiohttp.ClientSession() as session:
        await _traffic(session, url, n=2)
        before = await _scrape(session, url)
        # Long enough for 40 decode steps: gen_throughput is only set every 40.
        await _traffic(session, url, n=6, max_tokens=60)
        return before, await _scrape(session, url)


def test_sglang_exposition_matches_the_real_sample(
    sglang_texts: tuple[str, str], sglang_real: dict[str, Metric]
) -> None:
    emulated = families(sglang_texts[1], "sglang:")

    assert sorted(set(sglang_real) - set(SGLANG_EXCLUDED) - set(emulated)) == []
    assert sorted(set(emulated) - set(sglang_real)) == sorted(SGLANG_ADDED)
    for name, family in emulated.items():
        if name in sglang_real:
            real = sglang_real[name]
            assert (family.type, label_names(family)) == (real.type, label_names(real)), name
            assert bounds(family) == bounds(real), name
    assert label_names(emulated["sglang:max_total_num_tokens"]) == {"model_name"}


def test_sglang_dialect_reads_a_complete_snapshot(sglang_texts: tuple[str, str]) -> None:
    before, after = (parse_exposition(t) for t in sglang_texts)
    assert detect(after) == "sglang"
    builder = SnapshotBuilder("sg", get_dialect("sglang"))
    builder.observe(before, 0.0)
    snap = builder.observe(after, 1.0)

    assert not snap.stale
    assert snap.kv_capacity_tokens == load_profile("llama3-8b-h100").kv_cache_size_tokens
    assert snap.model_names == ("meta-llama/Meta-Llama-3-8B-Instruct",)
    # Counted when each request finished: six requests of 60 tokens.
    assert snap.generation_tokens_per_s == pytest.approx(6 * 60)
    for field in (
        "num_running", "num_waiting", "kv_cache_usage", "prompt_tokens_per_s", "itl_mean_s", "ttft_mean_s",
        "e2e_mean_s", "engine_decode_tokens_per_s",
    ):  # fmt: skip
        assert getattr(snap, field) is not None, field
