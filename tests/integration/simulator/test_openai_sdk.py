"""The emulator as a real process, driven by the real ``openai`` SDK (sync and async)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from simulator import tokens
from tests.integration.simulator.conftest import MAX_MODEL_LEN, Emulator, start_emulator, write_profile

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(emulator: Emulator) -> OpenAI:
    return OpenAI(base_url=f"{emulator.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient(emulator: Emulator) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{emulator.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def words(text: str) -> int:
    return tokens.count_text_tokens(text)


def test_models_list(client: OpenAI, emulator: Emulator) -> None:
    (card,) = client.models.list().data
    assert card.id == emulator.model
    assert card.owned_by == "vllm"
    assert card.model_extra is not None
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("max_tokens", [pytest.param(1, id="one"), pytest.param(17, id="seventeen")])
def test_completion_ignore_eos_exact_count(client: OpenAI, emulator: Emulator, max_tokens: int) -> None:
    out = client.completions.create(
        model=emulator.model, prompt="Count to ten", max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert words(out.choices[0].text) == max_tokens
    assert out.usage is not None
    assert out.usage.completion_tokens == max_tokens
    assert out.usage.prompt_tokens == tokens.count_completion_prompt("Count to ten")
    assert out.usage.total_tokens == out.usage.prompt_tokens + max_tokens


def test_chat_ignore_eos_exact_count(client: OpenAI, emulator: Emulator) -> None:
    out = client.chat.completions.create(
        model=emulator.model,
        messages=[{"role": "user", "content": "Say something."}],
        max_completion_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert words(out.choices[0].message.content or "") == 12
    assert out.usage is not None
    assert out.usage.completion_tokens == 12


def test_chat_without_ignore_eos_stops_within_max(client: OpenAI, emulator: Emulator) -> None:
    out = client.chat.completions.create(
        model=emulator.model, messages=[{"role": "user", "content": "hi"}], max_tokens=200
    )
    assert out.usage is not None
    assert 1 <= out.usage.completion_tokens <= 200
    expected = "length" if out.usage.completion_tokens == 200 else "stop"
    assert out.choices[0].finish_reason == expected


def test_chat_stream_with_usage(client: OpenAI, emulator: Emulator) -> None:
    stream = client.chat.completions.create(
        model=emulator.model,
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert sum(words(c.choices[0].delta.content or "") for c in content) == 20
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.completion_tokens, last.usage.total_tokens) == (20, last.usage.prompt_tokens + 20)
    assert {c.id for c in chunks} == {chunks[0].id}


def test_completion_stream_without_usage(client: OpenAI, emulator: Emulator) -> None:
    stream = client.completions.create(
        model=emulator.model, prompt="Once upon", max_tokens=9, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert sum(words(c.choices[0].text) for c in chunks) == 9
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_async_chat_and_completion_streams_concurrently(
    aclient: AsyncOpenAI, emulator: Emulator
) -> None:
    async def chat_stream() -> int:
        stream = await aclient.chat.completions.create(
            model=emulator.model,
            messages=[{"role": "user", "content": "a"}],
            max_tokens=15,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        last = None
        async for chunk in stream:
            last = chunk
        assert last is not None
        assert last.usage is not None
        return last.usage.completion_tokens

    async def completion() -> int:
        out = await aclient.completions.create(
            model=emulator.model, prompt=[1, 2, 3], max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None
        assert out.usage.prompt_tokens == 3
        return out.usage.completion_tokens

    assert list(await asyncio.gather(chat_stream(), completion(), chat_stream())) == [15, 8, 15]
    await aclient.close()


@pytest.mark.parametrize(
    ("kwargs", "exc_type", "status", "param"),
    [
        pytest.param({"model": "no-such-model"}, openai.NotFoundError, 404, "model", id="unknown-model"),
        pytest.param(
            {"max_tokens": MAX_MODEL_LEN + 1}, openai.BadRequestError, 400, "max_tokens", id="too-long"
        ),
        pytest.param(
            {"prompt": "x " * MAX_MODEL_LEN},
            openai.BadRequestError,
            400,
            "input_tokens",
            id="prompt-too-long",
        ),
        pytest.param({"n": 2}, openai.BadRequestError, 400, "n", id="n-above-one"),
        pytest.param({"max_tokens": 0}, openai.BadRequestError, 400, "max_tokens", id="zero-max-tokens"),
    ],
)
def test_errors_are_typed_sdk_exceptions(
    client: OpenAI, emulator: Emulator, kwargs: dict[str, object], exc_type: type[openai.APIStatusError],
    status: int, param: str,
) -> None:  # fmt: skip
    args: dict[str, object] = {"model": emulator.model, "prompt": "hello", **kwargs}
    with pytest.raises(exc_type) as caught:
        client.completions.create(**args)  # type: ignore[call-overload]
    err = caught.value
    assert err.status_code == status
    assert err.param == param
    assert err.code == str(status)
    assert isinstance(err.body, dict)
    assert set(err.body) == {"message", "type", "param", "code"}


async def test_async_errors_too(aclient: AsyncOpenAI, emulator: Emulator) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        await aclient.chat.completions.create(
            model=emulator.model, messages=[{"role": "user", "content": "x " * 1100}]
        )
    await aclient.close()


@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGTERM, id="sigterm"), pytest.param(signal.SIGINT, id="sigint")]
)
def test_exits_cleanly_on_signal(tmp_path: Path, sig: int) -> None:
    profile_path, model = write_profile(tmp_path)
    emu = start_emulator(profile_path, model, tmp_path / "log.txt")
    assert emu.stop(sig) == 0, emu.log()
