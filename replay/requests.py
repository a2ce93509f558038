"""The replay's requests and results: a request as the gateway sees it, what happened to it,
and the fleet it runs on.

``gateway_requests`` turns a trace into ``GatewayRequest``s (tenants round robin, the client's
``max_tokens``, characters when prompts go as text: ``PromptText``); ``Outcome`` is one request's
result as the gateway saw it, scored against ``Targets``; ``FleetConfig`` names the emulated
engines and how they are scraped. Times are virtual seconds. Plain values, no loop.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.prediction import ReplicaFacts
from gateway.replicas.scrape import DEFAULT_WINDOW_S
from replay.prefixes import prompt_text, prompt_token_ids
from replay.traces import TraceRequest
from simulator.profile import Profile

__all__ = ["FleetConfig", "GatewayRequest", "Outcome", "PromptText", "Targets", "gateway_requests"]


@dataclass(frozen=True, slots=True)
class Targets:
    """The latency targets a request is scored against, in seconds.

    ``ttft_s`` counts from the request's arrival at the gateway (queue wait included); ``tpot_s``
    is the mean time per output token after the first, as vLLM measures it.
    """

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """A request as a gateway sees it on arrival (never its true output length).

    ``arrival_s``: virtual seconds. ``max_tokens``: the client's output cap (tokens).
    ``tenant``: who sent it (the trace's, or assigned round robin). ``hash_ids``: its prompt's
    prefix blocks (``TraceRequest.hash_ids``; ``None``: its prompt shares nothing, and the
    engine's prefix cache never sees it): the engine gets ``token_ids()``, the gateway ``text()``.
    ``ignore_eos``: the client pinned its output to ``max_tokens`` (its true output then).
    """

    index: int
    tenant: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    prompt_chars: int | None = None
    hash_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def token_ids(self) -> list[int] | None:
        """Its prompt's token ids as the engine gets them (``replay.prefixes``); ``None``: no
        ``hash_ids``."""
        if self.hash_ids is None:
            return None
        return prompt_token_ids(self.hash_ids, self.prompt_tokens, tail_key=str(self.index))

    def text(self) -> str | None:
        """Its prompt as text, as the gateway gets it (``replay.prefixes``); ``None``: no
        ``hash_ids``."""
        if self.hash_ids is None:
            return None
        return prompt_text(self.hash_ids, self.prompt_tokens, tail_key=str(self.index))

    @property
    def sized_from_text(self) -> bool:
        """The gateway estimates the prompt's tokens from ``prompt_chars`` (its characters), as it
        does for a text prompt live; ``False``: sent as token ids, ``prompt_tokens`` is exact."""
        return self.prompt_chars is not None


@dataclass(frozen=True, slots=True)
class PromptText:
    """Prompts sent as text: request ``i``'s characters are its true tokens times a
    characters-per-token ratio drawn for it, log-normal with median ``chars_per_token`` and
    log-space standard deviation ``spread`` (a real tokeniser's ratio varies with the text:
    prose, code, other languages), seeded by ``seed`` and ``i``. The gateway sees only the
    characters and sizes the prompt from them at its learned ratio, as live."""

    chars_per_token: float = 4.0
    spread: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chars_per_token <= 0 or self.spread < 0:
            raise ValueError("chars_per_token must be > 0 and spread >= 0")

    def chars(self, index: int, tokens: int) -> int:
        """Characters of request ``index``'s ``tokens``-token prompt (>= 1)."""
        ratio = self.chars_per_token * math.exp(
            self.spread * random.Random(f"{self.seed}:{index}").gauss(0.0, 1.0)
        )
        return max(1, round(tokens * ratio))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request, from the gateway's side. Times in virtual seconds.

    ``rejected``: refused by the gateway (at once or after waiting in its queue), with ``reason``.
    ``finished_s`` is ``None`` for a request still running (or waiting in the engine) when the
    replay stopped. ``busy_s``: engine busy time attributed to it (see the module docstring).
    ``tpot_s``: the engine's mean time per output token after the first (``None`` below two
    tokens). ``cached_tokens``: prompt tokens its engine found in its prefix cache (0 unless it
    finished).
    """

    index: int
    tenant: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    rejected: bool
    reason: str
    replica: str | None
    dispatched_s: float | None
    first_token_s: float | None
    finished_s: float | None
    tpot_s: float | None
    busy_s: float
    preemptions: int
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Arrival at the gateway -> first token, seconds (``None`` without a first token)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def served(self) -> bool:
        """Sent to a replica (finished or not)."""
        return not self.rejected and self.dispatched_s is not None

    def met(self, targets: Targets) -> bool:
        """Finished with TTFT <= target and TPOT <= target (a one-token answer has no TPOT)."""
        ttft = self.ttft_s
        if self.rejected or self.finished_s is None or ttft is None or ttft > targets.ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= targets.tpot_s


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The fleet: ``replicas`` engines of ``profile`` (ground truth), ``facts`` for predictors.

    ``max_tokens``: the clients' output cap (lowered to ``max_model_len - prompt``).
    ``tenants``: tenants the requests are assigned to, round robin by arrival order.
    ``jitter``: engines' step-time noise; engine ``i`` is seeded ``seed + i``.
    ``scrape_interval_s`` / ``window_s``: as the live scraper's ``interval`` and ``window``.
    ``text``: prompts sent as text, sized by the gateway from their characters (``None``: sent
    as token ids, sized exactly). ``pinned_outputs``: the clients pin each output (``max_tokens``
    = its true output, with ``ignore_eos``), as ``vllm bench serve`` and ``bench.closed_loop`` do.
    """

    profile: Profile
    facts: ReplicaFacts
    replicas: int = 2
    max_tokens: int = 1000
    scrape_interval_s: float = 1.0
    jitter: float = 0.02
    seed: int = 0
    tenants: int = 4
    window_s: float = DEFAULT_WINDOW_S
    text: PromptText | None = None
    pinned_outputs: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_tokens < 1 or self.tenants < 1:
            raise ValueError("replicas, max_tokens and tenants must be >= 1")
        if self.scrape_interval_s <= 0 or self.window_s <= 0:
            raise ValueError("scrape_interval_s and window_s must be > 0")


def gateway_requests(
    trace: Sequence[TraceRequest], config: FleetConfig, *, check_fit: bool = True
) -> list[GatewayRequest]:
    """``trace`` as the gateway sees it: request ``i`` goes to tenant ``t{i % tenants}`` with
    ``max_tokens`` = the client's cap, lowered to ``max_model_len - prompt`` (never below the
    request's true output; its true output with ``config.pinned_outputs``); a request with
    ``hash_ids`` sent as text has its text's characters. ``check_fit``: raise ``ValueError`` for a
    request whose prompt and output exceed ``max_model_len`` (``fit_to_model_len`` leaves those out)."""
    limit = config.profile.engine.max_model_len
    requests: list[GatewayRequest] = []
    for i, t in enumerate(trace):
        if check_fit and t.prompt_tokens + t.output_tokens > limit:
            raise ValueError(f"request {i} does not fit max_model_len {limit}: use fit_to_model_len")
        pinned = config.pinned_outputs
        max_tokens = max(t.output_tokens, min(config.max_tokens, limit - t.prompt_tokens))
        request = GatewayRequest(
            i,
            f"t{i % config.tenants}",
            t.arrival_s,
            t.prompt_tokens,
            t.output_tokens if pinned else max_tokens,
            None,
            t.hash_ids,
            ignore_eos=pinned,
        )
        if config.text is not None:
            text = request.text()
            chars = config.text.chars(i, t.prompt_tokens) if text is None else len(text)
            request = dataclasses.replace(request, prompt_chars=chars)
        requests.append(request)
    return requests
