"""A request's prompt as one text for prefix-cache indexing, and the client session it names.

``prefix_text`` renders what the engine will prefill in an order that keeps shared prefixes
shared: a completion's prompt as sent; a chat's tool definitions, then each message's role and
text in order (a conversation's next turn starts with the text of the turns before it, as its
chat template's rendering does). It is not the template's exact text: it only has to agree
with itself across requests (``predictor.prefix_index``). Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from gateway.api.openai import ParsedRequest

__all__ = ["prefix_text", "session_of"]

#: Separators that never occur in JSON-decoded text a client sends by accident (ASCII RS and US).
_MESSAGE_END: Final = "\x1e"
_ROLE_END: Final = "\x1f"
#: Longest session id kept, characters (a longer one is cut: ids are keys, not payloads).
_MAX_SESSION_CHARS: Final = 256


def prefix_text(parsed: ParsedRequest) -> str | None:
    """The text to index for ``parsed`` (see the module); ``None`` when its prompt is not text
    (token ids) or it has several prompts (each would be a sequence of its own)."""
    body = parsed.body
    if parsed.endpoint == "chat":
        return _chat_text(body)
    if parsed.native:
        inputs = body.get("inputs")
        return inputs if isinstance(inputs, str) else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _chat_text(body: Mapping[str, Any]) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(json.dumps(tools, sort_keys=True, default=str) + _MESSAGE_END)
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        parts.append(role if isinstance(role, str) else "")
        parts.append(_ROLE_END)
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                # An image or audio part: its place is kept, its bytes are the engine's to hash.
                text = part.get("text") if isinstance(part, dict) else None
                parts.append(text if isinstance(text, str) else "\x00")
        calls = message.get("tool_calls")
        if calls:
            parts.append(json.dumps(calls, sort_keys=True, default=str))
        parts.append(_MESSAGE_END)
    return "".join(parts)


def session_of(
    headers: Mapping[str, str],
    parsed: ParsedRequest,
    *,
    header: str | None,
    from_user: bool,
    tenant: str | None,
) -> str | None:
    """The client session of a request (the ``header``'s value, else the body's ``user`` when
    ``from_user``), scoped by ``tenant`` so two tenants never share one; ``None``: the request
    names no session (or neither source is on)."""
    session: object = None
    if header is not None:
        session = headers.get(header)
    if not session and from_user:
        session = parsed.body.get("user")
    if not isinstance(session, str) or not session:
        return None
    return f"{tenant or ''}\x00{session[:_MAX_SESSION_CHARS]}"
