"""Per model, the tokenizer found and loaded once: configured first, then the Hugging Face cache by
the served id and by hardware.model; a reload forgets what was found; a file that does not load
leaves the prompts estimated (logged); a counter that fails is estimated too."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

import gateway.tokens.counter as counter_module
import gateway.tokens.live as live_module
from gateway.admission.sizing import PromptSize, prompt_size, prompt_size_of
from gateway.api.openai import OFF_LOOP_BYTES, ParsedRequest, parse_request
from gateway.api.responses import ModelCard
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.prediction.service import PredictionService
from gateway.replicas.registry import ReplicaRegistry
from gateway.tokens.counter import PromptTexts, TokenCount, prompt_texts
from gateway.tokens.live import PROMPT_TOKENIZERS, PromptTokenizers
from tests.support.tokenizer import tokenizer, write_hub_snapshot, write_tokenizer

MODEL = "acme/Tiny-Chat-1B"
PROMPT = "Sluice admits each request whose forecast meets its targets, or queues it."


def settings(**replica: Any) -> Settings:
    return Settings.model_validate({"replicas": [{"name": "r1", "url": "http://127.0.0.1:9", **replica}]})


def fleet(store: SettingsStore, *models: str) -> ReplicaRegistry:
    registry = ReplicaRegistry(store)
    for replica in registry.replicas():
        replica.models = {m: ModelCard(m, 4096, {"id": m}) for m in models}
    return registry


def completion(prompt: str = PROMPT, model: str = MODEL) -> ParsedRequest:
    return parse_request("completions", json.dumps({"model": model, "prompt": prompt}).encode())


def exact(prompt: str = PROMPT) -> TokenCount:
    count = len(tokenizer().encode(prompt).ids)
    return TokenCount(count, count, True)


async def test_a_configured_tokenizer_counts_and_a_reload_forgets_it(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "tiny")
    store = SettingsStore(settings(tokenizer=str(path)))
    tokenizers = PromptTokenizers(store, fleet(store, MODEL), env={})
    assert tokenizers.tokenizer_path(MODEL) == path
    assert await tokenizers.count(completion()) == exact()
    assert await tokenizers.count(completion(model="other/model")) is None  # served by no replica

    store.swap(settings())
    # The swapped-in replica serves nothing until its models are fetched again.
    assert await tokenizers.count(completion()) is None


async def test_long_prompts_are_counted_in_a_worker_thread_alike(tmp_path: Path) -> None:
    store = SettingsStore(settings(tokenizer=str(write_tokenizer(tmp_path / "tiny"))))
    tokenizers = PromptTokenizers(store, fleet(store, MODEL), env={})
    long = PROMPT * 100  # over OFF_LOOP_CHARS
    assert await tokenizers.count(completion(long)) == exact(long)


@pytest.mark.parametrize("by", ["served-id", "hardware-model"])
async def test_the_hugging_face_cache_is_searched_by_served_id_then_hardware_model(
    tmp_path: Path, by: str
) -> None:
    hub = tmp_path / "hub"
    served = MODEL if by == "served-id" else "tiny"  # e.g. vLLM's --served-model-name tiny
    path = write_hub_snapshot(hub, MODEL)
    store = SettingsStore(settings(hardware={"model": MODEL}))
    tokenizers = PromptTokenizers(store, fleet(store, served), env={"HF_HUB_CACHE": str(hub)})
    assert tokenizers.tokenizer_path(served) == path
    assert await tokenizers.count(completion(model=served)) == exact()


async def test_a_file_that_does_not_load_leaves_prompts_estimated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not a tokenizer", encoding="utf-8")
    store = SettingsStore(settings(tokenizer=str(broken)))
    tokenizers = PromptTokenizers(store, fleet(store, MODEL), env={})
    with caplog.at_level(logging.WARNING, logger="sluice.tokens"):
        assert await tokenizers.count(completion()) is None
        assert await tokenizers.count(completion()) is None
    lines = [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "sluice.tokens"]
    assert lines == [f"tokenizer {broken} does not load"]


class _Failing(PromptTokenizers):
    async def count(self, parsed: ParsedRequest) -> TokenCount | None:
        raise RuntimeError("boom")


async def test_sizing_counts_first_and_estimates_when_counting_fails(tmp_path: Path) -> None:
    store = SettingsStore(settings(tokenizer=str(write_tokenizer(tmp_path / "tiny"))))
    app = web.Application()
    app[PROMPT_TOKENIZERS] = PromptTokenizers(store, fleet(store, MODEL), env={})
    service = PredictionService()
    count = exact().tokens
    request = make_mocked_request("POST", "/v1/completions", app=app)
    assert await prompt_size(request, service, completion()) == PromptSize(count, count, True)

    app = web.Application()
    app[PROMPT_TOKENIZERS] = _Failing(store, fleet(store, MODEL), env={})
    request = make_mocked_request("POST", "/v1/completions", app=app)
    assert await prompt_size(request, service, completion()) == prompt_size_of(service, completion())


async def test_a_model_no_replica_serves_is_not_looked_up(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    write_hub_snapshot(hub, "other/model")
    store = SettingsStore(settings())
    tokenizers = PromptTokenizers(store, fleet(store, MODEL), env={"HF_HUB_CACHE": str(hub)})
    assert tokenizers.tokenizer_path("other/model") is None
    assert await tokenizers.count(completion(model="other/model")) is None


async def test_a_big_bodys_prompt_is_gathered_and_counted_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body of ``OFF_LOOP_BYTES`` or more: even its texts (one per message, some 30,000 of them in
    a maximum-size body) are gathered in the worker thread, and counted as a small body's are."""
    store = SettingsStore(settings(tokenizer=str(write_tokenizer(tmp_path / "tiny"))))
    tokenizers = PromptTokenizers(store, fleet(store, MODEL), env={})
    messages = [{"role": "user", "content": PROMPT}] * (OFF_LOOP_BYTES // len(PROMPT) + 1)
    parsed = parse_request("chat", json.dumps({"model": MODEL, "messages": messages}).encode())
    assert len(parsed.raw) >= OFF_LOOP_BYTES
    gathered_on: list[bool] = []

    def recording(request: ParsedRequest) -> PromptTexts | None:
        gathered_on.append(threading.current_thread() is threading.main_thread())
        return prompt_texts(request)

    monkeypatch.setattr(counter_module, "prompt_texts", recording)
    monkeypatch.setattr(live_module, "prompt_texts", recording)

    count = await tokenizers.count(parsed)

    assert gathered_on == [False]
    loaded, texts = await tokenizers.counter(MODEL), prompt_texts(parsed)
    assert loaded is not None
    assert texts is not None
    assert count == loaded.count_texts(texts)
