"""A request's prompt size, counted or estimated once per request and carried on it.

``prompt_size(request, service, parsed, tenant)`` counts it with the model's tokenizer when Sluice
has one (``gateway.tokens``: exact for completions and for chats its chat template renders, else
close, with their lowest plausible count), else estimates it as ``estimated_prompt_size`` does.
The estimate: exact when the prompt was sent as token ids, else its characters at the tenant's
learned characters per token (``PredictionService.estimate_prompt_tokens``: the tenant's own
ratio, blended with a fleet prior no other single tenant decides; 4 characters per token when the
service fails), at least 1. With it comes the lowest plausible count (``PromptSize.fewest``), the
only size a prompt may be refused as too long on: an estimate alone never refuses it. The first
caller pays and stores it on the request (``PROMPT_SIZE``); every later caller on the same
request, admission's forecast and the in-flight entry the proxy leases, reads the same numbers,
so the budget is charged for the prompt admission judged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from gateway.api.openai import ParsedRequest
from gateway.prediction.service import PredictionService
from gateway.tokens.counter import TokenCount
from gateway.tokens.live import PROMPT_TOKENIZERS

__all__ = [
    "PROMPT_SIZE",
    "PromptSize",
    "counted_size",
    "estimated_prompt_size",
    "prompt_size",
    "prompt_size_of",
]

log = logging.getLogger("sluice.sizing")

#: Characters per token when the prediction service fails: its prior, and its highest plausible.
_FALLBACK_CHARS_PER_TOKEN: Final = 4
_FALLBACK_MOST_CHARS_PER_TOKEN: Final = 16


@dataclass(frozen=True, slots=True)
class PromptSize:
    """A prompt's size in tokens. ``tokens`` (>= 1): counted or estimated, what the request is
    forecast and reserved with. ``fewest`` (1 <= fewest <= tokens): the lowest plausible count of
    one sequence's prompt (the longest of a list of prompts), ``tokens`` itself when ``exact`` and
    one prompt. ``exact``: counted (token ids), not estimated."""

    tokens: int
    fewest: int
    exact: bool


#: The request's prompt size as estimated by its first ``estimated_prompt_size`` call.
PROMPT_SIZE = web.RequestKey("prompt_size", PromptSize)


def prompt_size_of(
    service: PredictionService, parsed: ParsedRequest, tenant: str | None = None
) -> PromptSize:
    """The size of ``parsed``'s prompt: exact for token-id prompts, else its characters at
    ``tenant``'s learned ratio for its model (``None``: requests of no tenant), with the lowest
    plausible count; 4 (and at most 16) characters per token when the service raises."""
    if parsed.prompt_token_ids is not None:
        exact = max(parsed.prompt_token_ids, 1)
        return _per_sequence(parsed, PromptSize(exact, exact, True), exact)
    chars = max(parsed.prompt_chars, 0)
    try:
        tokens = max(service.estimate_prompt_tokens(parsed.model, chars, tenant), 1)
        fewest = service.fewest_prompt_tokens(chars)
    except Exception:
        log.exception("prompt-token estimate failed; using 4 characters per token")
        tokens = max(chars // _FALLBACK_CHARS_PER_TOKEN, 1)
        fewest = math.ceil(chars / _FALLBACK_MOST_CHARS_PER_TOKEN)
    return _per_sequence(parsed, PromptSize(tokens, min(max(fewest, 1), tokens), False), chars)


def _per_sequence(parsed: ParsedRequest, size: PromptSize, units: int) -> PromptSize:
    """``size`` with ``fewest`` scaled to the longest of several prompts (``units``: all of them,
    in ``parsed.longest_prompt``'s unit): each prompt of a list is a sequence of its own, so only
    the longest must fit a replica's context. ``size`` itself for one prompt."""
    if parsed.longest_prompt is None or units <= 0:
        return size
    share = min(parsed.longest_prompt / units, 1.0)
    return PromptSize(size.tokens, min(max(math.ceil(size.fewest * share), 1), size.tokens), size.exact)


def estimated_prompt_size(
    request: web.Request, service: PredictionService, parsed: ParsedRequest, tenant: str | None = None
) -> PromptSize:
    """``prompt_size_of(service, parsed, tenant)``, computed on the first call for ``request`` and
    read back from it (``PROMPT_SIZE``) on every later one."""
    size = request.get(PROMPT_SIZE)
    if size is None:
        size = request[PROMPT_SIZE] = prompt_size_of(service, parsed, tenant)
    return size


def counted_size(count: TokenCount) -> PromptSize:
    """A prompt counted by its tokenizer as a ``PromptSize``."""
    return PromptSize(count.tokens, count.fewest, count.exact)


async def prompt_size(
    request: web.Request, service: PredictionService, parsed: ParsedRequest, tenant: str | None = None
) -> PromptSize:
    """``request``'s prompt size, computed once and stored on it (``PROMPT_SIZE``): counted by the
    app's ``PROMPT_TOKENIZERS`` when its model's tokenizer is known and the prompt is text, else
    ``prompt_size_of(service, parsed, tenant)``. A counter that fails is logged and estimated."""
    known: PromptSize | None = request.get(PROMPT_SIZE)
    if known is not None:
        return known
    tokenizers = request.config_dict.get(PROMPT_TOKENIZERS)
    count: TokenCount | None = None
    if tokenizers is not None:
        try:
            count = await tokenizers.count(parsed)
        except Exception:
            log.exception("counting prompt tokens failed; estimating them")
    size = prompt_size_of(service, parsed, tenant) if count is None else counted_size(count)
    request[PROMPT_SIZE] = size
    return size
