"""A replica's context length (``max_model_len``) from its engine's info endpoint.

For engines whose ``/v1/models`` omits it: TGI's ``GET /info`` (``max_total_tokens``, else
``max_input_tokens`` + 1) and SGLang's ``GET /get_server_info`` (``context_length``, else
``max_req_input_len`` + 1, else ``max_total_num_tokens``). ``context_length_from_info`` is pure;
``fill_context_length`` does the one request the health checker needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import aiohttp

if TYPE_CHECKING:  # at run time only its instances are touched (no import cycle)
    from gateway.api.responses import ModelCard

#: Info endpoints that tell a context length, with the engine each belongs to, in probe order.
CONTEXT_PATHS: Final = (("tgi", "/info"), ("sglang", "/get_server_info"))


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def context_length_from_info(engine: str, body: Any) -> int | None:
    """The context length in tokens that ``engine``'s info body (parsed JSON) states; ``None`` when
    it states none (or ``body`` is not that engine's)."""
    if not isinstance(body, dict):
        return None
    if engine == "tgi":
        total = _positive_int(body.get("max_total_tokens"))
        if total is not None:
            return total
        prompt = _positive_int(body.get("max_input_tokens")) or _positive_int(body.get("max_input_length"))
        return None if prompt is None else prompt + 1
    if engine == "sglang":
        context = _positive_int(body.get("context_length"))
        if context is not None:
            return context
        prompt = _positive_int(body.get("max_req_input_len"))
        if prompt is not None:
            return prompt + 1
        return _positive_int(body.get("max_total_num_tokens"))
    return None


async def fetch_context_length(
    session: aiohttp.ClientSession, base_url: str, engine: str | None, timeout_s: float
) -> int | None:
    """``GET`` the info endpoint of ``engine`` (both, in turn, when ``None``: not yet detected)
    at ``base_url`` and read the context length from it; ``None`` on any failure or silence."""
    for name, path in CONTEXT_PATHS:
        if engine is not None and engine != name:
            continue
        try:
            async with session.get(base_url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    continue
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
        length = context_length_from_info(name, body)
        if length is not None:
            return length
    return None


async def fill_context_length(
    session: aiohttp.ClientSession,
    base_url: str,
    engine: str | None,
    cards: Mapping[str, ModelCard],
    timeout_s: float,
) -> dict[str, ModelCard]:
    """``cards`` (a replica's ``/v1/models``, by id), each one without a ``max_model_len`` given
    the one its engine's info endpoint states. vLLM replicas, and lists where every card has a
    length, cost no request; when the endpoint says nothing the cards come back as they were."""
    result = dict(cards)
    missing = [k for k, card in result.items() if card.max_model_len is None]
    if not missing or engine == "vllm":
        return result
    length = await fetch_context_length(session, base_url, engine, timeout_s)
    if length is None:
        return result
    for key in missing:
        result[key] = dataclasses.replace(result[key], max_model_len=length)
    return result
