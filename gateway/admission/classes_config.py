"""A request class's settings (``admission.classes.<name>``): its targets and how it is admitted.

``ClassSettings`` holds a class's TTFT and TPOT targets, its queue, priority, shares and stall
budget, the attainment it must hold and its size fairness (``SizeFairnessSettings``); the two
built-in classes are ``interactive_class`` and ``batch_class``. House style as ``gateway.admission.config``,
which composes them into the ``admission:`` section.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gateway.config.section import Name, PositiveSeconds, Section

__all__ = [
    "INTERACTIVE_STALL_BUDGET_HORIZON",
    "ClassSettings",
    "Fraction",
    "SizeFairnessSettings",
    "batch_class",
    "interactive_class",
]

Fraction = Annotated[float, Field(gt=0, le=1)]


class SizeFairnessSettings(Section):
    """A class's protection of its long prompts under overload (``gateway.admission.size_share``).

    Admission refuses long prompts first when replicas are loaded (their prefill takes the most of
    running streams' budgets). This keeps every prompt-size quartile's admission rate, over a
    sliding window, at least ``min_share`` of the best quartile's: a request of a quartile below
    that waits in the queue ahead of the class's others, which are held back meanwhile, until it
    fits every limit (running streams and its own targets are never relaxed).
    """

    enabled: Annotated[
        bool,
        Field(
            description="Protect the longest prompts (false: admit whatever fits first, shorter prompts "
            "mostly, for the most requests meeting their targets)."
        ),
    ] = True
    min_share: Annotated[
        Fraction,
        Field(
            description="Smallest admission rate of a prompt-size quartile, as a share (0-1] of the "
            "best quartile's, before its requests are protected."
        ),
    ] = 0.4
    window_s: Annotated[
        PositiveSeconds,
        Field(
            description="Sliding window, in seconds, over which the quartiles and their rates are measured."
        ),
    ] = 60.0
    min_samples: Annotated[
        int,
        Field(ge=1, description="Decided requests a quartile needs in the window before it is judged."),
    ] = 20
    max_samples: Annotated[
        int,
        Field(
            ge=4,
            description="Most decided requests kept in the window (bounds memory and the work per refresh).",
        ),
    ] = 2000


class ClassSettings(Section):
    """One request class: its latency targets, its deadline, its place in the queue, its limits."""

    ttft_target_s: Annotated[
        PositiveSeconds,
        Field(
            description="Time-to-first-token target, in seconds, counted from the request's arrival at "
            "Sluice (queue wait included). A request is sent to a replica only if its predicted first "
            "token comes within it."
        ),
    ] = 2.0
    tpot_target_s: Annotated[
        PositiveSeconds,
        Field(
            description="Time-per-output-token target, in seconds: the request's own predicted mean TPOT "
            "must stay within it, and no newcomer may push a running request of this class past it."
        ),
    ] = 0.1
    max_queue_wait_s: Annotated[
        float,
        Field(
            ge=0,
            description="Deadline for leaving Sluice's queue, in seconds after arrival: a queued request "
            "still waiting then is rejected with deadline_exceeded. 0 = never queue (reject at once "
            "when no replica can take the request).",
        ),
    ] = 1.0
    priority: Annotated[
        int,
        Field(
            ge=0,
            description="Queue priority; LOWER is more important. Queued requests of a more important "
            "class are always dispatched first.",
        ),
    ] = 0
    max_prompt_tokens: Annotated[
        int,
        Field(
            ge=1, description="Largest prompt accepted in this class, in tokens; larger -> prompt_too_large."
        ),
    ] = 131_072
    queue_capacity: Annotated[
        int,
        Field(ge=0, description="Most requests of this class waiting in Sluice's queue; full -> overloaded."),
    ] = 256
    kv_share: Annotated[
        Fraction,
        Field(
            description="Largest share (0-1] of each replica's KV cache this class's requests may hold "
            "together, counted at their projected size (prompt + predicted output). 1 = no limit."
        ),
    ] = 1.0
    slot_share: Annotated[
        Fraction,
        Field(
            description="Largest share (0-1] of each replica's decode slots this class may hold; the slots "
            "are min(max_num_seqs, the decode batch the step model says meets the tightest TPOT target). "
            "1 = no limit."
        ),
    ] = 1.0
    yields_to: Annotated[
        list[Name],
        Field(
            description="Classes (more important, by priority) whose slack this class may only use: it is "
            "admitted on a replica only if a typical request of each of them (see probe_*) would still "
            "meet its targets with `admission.yield_margin` to spare afterwards."
        ),
    ] = Field(default_factory=list)
    max_stall_s: Annotated[
        PositiveSeconds | None,
        Field(
            description="Longest extra pause, in seconds, a newcomer's prefill may add to a running "
            "stream of this class (a long prompt freezes every stream for its prefill steps). "
            "null = only the mean-TPOT rule protects these streams."
        ),
    ] = None
    stall_budget_horizon: Annotated[
        Fraction | None,
        Field(
            description="Turns on the per-stream stall budget for running streams of this class: a "
            "newcomer is held or refused when the pause its prefill adds (plus the prefill already "
            "queued on the replica) would push any stream's final mean TPOT past tpot_target_s, "
            "counting the time that stream's decode has already taken. Each stream is assumed to "
            "produce at least this share (0-1] of its expected remaining output (a stream may end "
            "sooner than expected, and a short stream has little room). While on, the mean-TPOT rule "
            "for running streams leaves the prefill pause to this budget, and a newcomer's own TPOT "
            "is judged without the replica's recent prefill share (the prefill admitted after it "
            "must fit its budget): its decode step, when lower than the forecast. null = off. "
            "The built-in interactive class has 0.02 (a stream may end at its next token).",
        ),
    ] = None
    probe_prompt_tokens: Annotated[
        int,
        Field(
            ge=1,
            description="Prompt size, in tokens, of a typical request of this class: the probe that "
            "classes yielding to this one must leave room for.",
        ),
    ] = 1024
    probe_output_tokens: Annotated[
        int,
        Field(ge=1, description="Output size, in tokens, of the typical request (see probe_prompt_tokens)."),
    ] = 256
    attainment_target: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description="Share (0-1) of this class's admitted requests that must meet both targets "
            "(first token by its deadline, mean TPOT within tpot_target_s), on each replica: the "
            "attainment controller (admission.attainment) moves the class's margin there to hold it.",
        ),
    ] = 0.95
    size_fairness: Annotated[
        SizeFairnessSettings,
        Field(description="Keep the longest prompts from being shut out under overload."),
    ] = SizeFairnessSettings()


#: ``stall_budget_horizon`` of the built-in interactive class (docs/benchmarks.md, goodput).
INTERACTIVE_STALL_BUDGET_HORIZON = 0.02


def interactive_class() -> ClassSettings:
    """The built-in ``interactive`` class: the defaults, with a stall budget."""
    return ClassSettings(stall_budget_horizon=INTERACTIVE_STALL_BUDGET_HORIZON)


def batch_class() -> ClassSettings:
    """The built-in ``batch`` class: loose targets, a deep queue, half the KV and slots, and it
    yields to ``interactive``."""
    return ClassSettings(
        ttft_target_s=60.0,
        tpot_target_s=0.5,
        max_queue_wait_s=30.0,
        priority=10,
        queue_capacity=1024,
        kv_share=0.5,
        slot_share=0.5,
        yields_to=["interactive"],
    )
