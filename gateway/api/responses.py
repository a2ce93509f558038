"""What a replica answers on the OpenAI routes, read: usage, the first token, and model lists.

``usage_of`` and ``is_usage_only_chunk`` find the token counts in a response body or stream chunk
(and the extra chunk ``include_usage`` adds), ``carries_tokens`` tells whether a chunk delivers
output (the first one is TTFT), and ``parse_models`` / ``models_list`` read a replica's
``/v1/models`` and merge several into the gateway's. Pure: anything malformed reads as missing
(``None``, ``False``), except a ``/v1/models`` body, which raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts a replica reported; ``None`` where the field was missing or not an integer.
    ``cached_tokens``: prompt tokens that hit its prefix cache (``prompt_tokens_details``; vLLM
    reports it when started with ``--enable-prompt-tokens-details``)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None = None


def usage_of(payload: object) -> Usage | None:
    """The ``usage`` object of a response body or stream chunk, or ``None`` if it has none."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(
        _int_or_none(usage.get("prompt_tokens")), _int_or_none(usage.get("completion_tokens")), cached
    )


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_usage_only_chunk(payload: object) -> bool:
    """True for the extra chunk ``include_usage`` adds at the end: ``choices: []`` plus usage."""
    return (
        isinstance(payload, dict) and payload.get("choices") == [] and isinstance(payload.get("usage"), dict)
    )


def carries_tokens(payload: object) -> bool:
    """True when a stream chunk delivers generated output (text, content, tool calls) or a finish.

    vLLM's first chat chunk may carry only the assistant role; it does not count as the first
    token for TTFT.
    """
    if not isinstance(payload, dict):
        return False
    choices = payload.get("choices")
    if not isinstance(choices, list):
        return False
    return any(_choice_carries_tokens(choice) for choice in choices)


def _choice_carries_tokens(choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One model a replica serves, as its ``/v1/models`` described it.

    ``max_model_len`` is the context length in tokens (``None`` if the replica did not say).
    ``card`` is the replica's JSON object for the model, passed on to clients as-is.
    """

    id: str
    max_model_len: int | None
    card: Mapping[str, Any]


def parse_models(payload: object) -> dict[str, ModelCard]:
    """The model cards of a ``/v1/models`` body, keyed by id; raises ``ValueError`` if malformed."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("a /v1/models body must be an object with a `data` list")
    cards: dict[str, ModelCard] = {}
    for entry in payload["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise ValueError(f"a /v1/models entry must be an object with a string `id`: {entry!r}")
        cards[entry["id"]] = ModelCard(entry["id"], _int_or_none(entry.get("max_model_len")), entry)
    return cards


def models_list(per_replica: Iterable[Mapping[str, ModelCard]]) -> dict[str, Any]:
    """The gateway's ``/v1/models`` body: the union of the given replicas' models, one per id.

    A model served by several replicas appears once, with the first replica's card, except that
    ``max_model_len`` is the smallest among them: a request may land on any of them.
    """
    merged: dict[str, dict[str, Any]] = {}
    for cards in per_replica:
        for model_id, card in cards.items():
            if model_id not in merged:
                merged[model_id] = dict(card.card)
                continue
            known = merged[model_id].get("max_model_len")
            if card.max_model_len is not None and (not isinstance(known, int) or card.max_model_len < known):
                merged[model_id]["max_model_len"] = card.max_model_len
    return {"object": "list", "data": list(merged.values())}
