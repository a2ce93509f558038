"""A request's prompt size, estimated once per request and carried on it.

``estimated_prompt_tokens(request, service, parsed)`` is the one estimate: exact when the prompt
was sent as token ids, else its characters at the prediction service's learned characters per
token (4 when the service fails), at least 1. The first caller (the tenancy middleware, when a
tenant has a budget; admission otherwise) pays and stores it on the request (``PROMPT_TOKENS``);
every later caller on the same request, admission's forecast and the in-flight entry the proxy
leases, reads the same number, so the budget is charged for the prompt admission judged.
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.api.openai import ParsedRequest
from gateway.prediction.service import PredictionService

__all__ = ["PROMPT_TOKENS", "estimated_prompt_tokens", "prompt_tokens_of"]

log = logging.getLogger("sluice.sizing")

#: The request's prompt tokens as estimated by its first ``estimated_prompt_tokens`` call.
PROMPT_TOKENS = web.RequestKey("prompt_tokens", int)


def prompt_tokens_of(service: PredictionService, parsed: ParsedRequest) -> int:
    """Prompt tokens of ``parsed`` (>= 1): exact for token-id prompts, else its characters at the
    service's learned ratio for its model; 4 characters per token when the service raises."""
    if parsed.prompt_token_ids is not None:
        return max(parsed.prompt_token_ids, 1)
    try:
        return max(service.estimate_prompt_tokens(parsed.model, parsed.prompt_chars), 1)
    except Exception:
        log.exception("prompt-token estimate failed; using 4 characters per token")
        return max(parsed.prompt_chars // 4, 1)


def estimated_prompt_tokens(request: web.Request, service: PredictionService, parsed: ParsedRequest) -> int:
    """``prompt_tokens_of(service, parsed)``, computed on the first call for ``request`` and read
    back from it (``PROMPT_TOKENS``) on every later one."""
    tokens = request.get(PROMPT_TOKENS)
    if tokens is None:
        tokens = request[PROMPT_TOKENS] = prompt_tokens_of(service, parsed)
    return tokens
