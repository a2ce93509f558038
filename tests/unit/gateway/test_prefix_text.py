"""A request's prompt as text for the prefix index, and its session: shared prefixes stay shared,
and whatever a client sends in odd shapes gives no text or no session, never an error."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gateway.api.openai import OFF_LOOP_BYTES, ParsedRequest, off_loop
from gateway.api.prefix_text import prefix_text, session_of


def parsed(endpoint: str, body: dict[str, Any]) -> ParsedRequest:
    return ParsedRequest(
        endpoint=endpoint,  # type: ignore[arg-type]
        model="m",
        stream=False,
        include_usage=False,
        max_tokens=None,
        body=body,
        raw=b"",
    )


def chat(*messages: object, **extra: object) -> ParsedRequest:
    return parsed("chat", {"messages": list(messages), **extra})


def test_a_conversations_next_turn_starts_with_the_text_of_the_turns_before() -> None:
    first = prefix_text(chat({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}))
    later = prefix_text(
        chat(
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"},
        )
    )
    assert first is not None
    assert later is not None
    assert later.startswith(first)
    # Tools come first: the same tools, a shared prefix; other tools, none.
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = prefix_text(chat({"role": "user", "content": "hi"}, tools=tools))
    assert with_tools is not None
    assert with_tools != prefix_text(chat({"role": "user", "content": "hi"}))


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("completions", {"prompt": "abc"}, "abc"),
        ("completions", {"prompt": ["abc"]}, "abc"),
        ("completions", {"prompt": ["a", "b"]}, None),  # two sequences of their own
        ("completions", {"prompt": [1, 2, 3]}, None),  # token ids
        ("completions", {"prompt": None}, None),
        ("chat", {"messages": []}, None),
        ("chat", {"messages": "hi"}, None),
        ("chat", {"messages": ["hi"]}, None),
    ],
    ids=[
        "string",
        "one-item-list",
        "several",
        "token-ids",
        "null",
        "no-messages",
        "not-a-list",
        "not-a-dict",
    ],
)
def test_prompts_that_are_not_one_text_give_none(
    endpoint: str, body: dict[str, Any], expected: str | None
) -> None:
    assert prefix_text(parsed(endpoint, body)) == expected


def test_odd_message_shapes_still_give_text() -> None:
    text = prefix_text(
        chat(
            {"role": 3, "content": None},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"text": "t"}, "junk"],
            },
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
        )
    )
    assert text is not None
    assert "t" in text


@pytest.mark.parametrize(
    ("headers", "body", "from_user", "expected"),
    [
        ({"x-session-id": "s1"}, {}, False, "acme\x00s1"),
        ({}, {"user": "u1"}, True, "acme\x00u1"),
        ({}, {"user": "u1"}, False, None),
        ({"x-session-id": ""}, {"user": {"id": 1}}, True, None),  # empty header, a user that is no string
        ({"x-session-id": "s" * 10_000}, {}, False, "acme\x00" + "s" * 256),  # cut: a key, not a payload
    ],
    ids=["header", "user-field", "user-field-off", "neither-usable", "long-id-cut"],
)
def test_the_session_is_scoped_by_tenant_and_never_an_error(
    headers: dict[str, str], body: dict[str, Any], from_user: bool, expected: str | None
) -> None:
    got = session_of(headers, parsed("chat", body), header="x-session-id", from_user=from_user, tenant="acme")
    assert got == expected


@pytest.mark.parametrize(("padding", "on_loop"), [(0, True), (OFF_LOOP_BYTES, False)], ids=["small", "large"])
async def test_a_large_bodys_prefix_text_is_built_off_the_event_loop(padding: int, on_loop: bool) -> None:
    loop_thread = threading.get_ident()
    threads: list[int] = []
    request = ParsedRequest(
        endpoint="chat",
        model="m",
        stream=False,
        include_usage=False,
        max_tokens=None,
        body={"messages": [{"role": "user", "content": "hi"}]},
        raw=b" " * padding,
    )

    def text() -> str | None:
        threads.append(threading.get_ident())
        return prefix_text(request)

    assert await off_loop(request, text) == prefix_text(request)
    assert (threads == [loop_thread]) is on_loop
    assert len(threads) == 1
