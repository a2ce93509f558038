"""What the closed-loop bench sends: real traces, their sizes scaled to the CPU model, re-timed.

A trace (``TraceSpec``) is one of the project's real traces (``replay.traces``): the Azure 2023
conversation trace or the Mooncake FAST'25 conversation trace. Its prompt and output sizes are
multiplied by the spec's scales (rounded, at least one token) so that they fit the CPU model's
context and speed; requests whose scaled prompt and output still exceed the context are left out
and counted, as a real engine would answer them 400. A point's arrivals are the trace's own
gaps, compressed to the point's mean rate (``replay.traces.piecewise_rate``), so each load keeps
the trace's burst shape and every load replays the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from replay.traces import (
    TraceRequest,
    fit_to_model_len,
    load_azure_trace,
    load_mooncake_trace,
    piecewise_rate,
)

__all__ = ["TRACES", "Arrival", "TraceSpec", "prompt_text", "scaled", "schedule"]

#: Tokens kept free of the context for the chat template (role markers, BOS) and the error of
#: sizing a prompt text by a measured characters-per-token ratio.
TEMPLATE_SLACK_TOKENS: Final = 64
#: Words prompt texts are made of: only their token count matters.
_WORDS: Final = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
)


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """One trace and how its sizes are scaled.

    ``prompt_scale`` / ``output_scale``: factors (0-1] applied to the trace's prompt and output
    tokens. ``rows``: how many rows from the trace's start are read (the prompt-size quartiles
    are those of these rows; a point takes the first ``ceil(duration x rate)`` requests that fit,
    and a run whose largest point needs more reads the whole trace: ``scaled``'s ``whole``).
    """

    name: str
    title: str
    load: Callable[..., list[TraceRequest]]
    prompt_scale: float
    output_scale: float
    rows: int = 4000


#: Outputs are scaled less than prompts: the tiny model's steps are so short that at x0.1 (about
#: 25 tokens) the engine completes tens of requests per second, more than the client and the
#: gateway sharing the host's cores can send and relay without becoming the bottleneck.
TRACES: Final = {
    "azure": TraceSpec("azure", "Azure LLM 2023, conversation", load_azure_trace, 0.1, 0.5),
    # Mooncake's prompts are ten times Azure's (mean 12 K tokens): at x0.1 over 40 % of them would
    # not fit a 1,024-token context; at x0.03 about 10 % do not, and its prompts stay about twice
    # Azure's (it remains the prefill-heavy trace).
    "mooncake": TraceSpec("mooncake", "Mooncake FAST'25, conversation", load_mooncake_trace, 0.03, 0.3),
}


def scaled(spec: TraceSpec, max_model_len: int, *, whole: bool = False) -> tuple[list[TraceRequest], int]:
    """(the trace's first ``spec.rows`` requests, or all of them when ``whole``, with scaled sizes
    that fit, how many did not).

    A request fits when its scaled prompt and output leave ``TEMPLATE_SLACK_TOKENS`` of
    ``max_model_len`` free. Arrivals are the trace's own (seconds from its first row).
    """
    rows = spec.load(count=None if whole else spec.rows)
    sized = [
        TraceRequest(
            r.arrival_s,
            max(1, round(r.prompt_tokens * spec.prompt_scale)),
            max(1, round(r.output_tokens * spec.output_scale)),
        )
        for r in rows
    ]
    return fit_to_model_len(sized, max_model_len - TEMPLATE_SLACK_TOKENS)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a point: when it is sent (seconds from the point's start), its index in the
    scaled trace (which seeds its prompt text) and its sizes in tokens."""

    at_s: float
    index: int
    prompt_tokens: int
    output_tokens: int


def schedule(requests: Sequence[TraceRequest], rate_per_s: float, duration_s: float) -> list[Arrival]:
    """The first ``ceil(duration_s x rate_per_s)`` of ``requests``, their gaps compressed to a mean
    rate of ``rate_per_s`` over ``duration_s`` seconds (fewer when the requests run out)."""
    timed = piecewise_rate(requests, [(duration_s, rate_per_s)])
    return [Arrival(r.arrival_s, i, r.prompt_tokens, r.output_tokens) for i, r in enumerate(timed)]


def prompt_text(tokens: int, chars_per_token: float, seed: int) -> str:
    """A text of about ``tokens`` tokens for a tokenizer that reads ``chars_per_token`` characters
    per token of such text (``client.chars_per_token`` measures it); words drawn from ``seed``, so
    two prompts share no prefix an engine's prefix cache could reuse."""
    rng = random.Random(seed)
    want = max(1, round(tokens * chars_per_token))
    words: list[str] = [str(seed)]
    length = len(words[0])
    while length < want:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:want]
