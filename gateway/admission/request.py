"""The request as admission sees it: sizes, class, arrival and deadline (no HTTP, no clock)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.admission.config import ClassSettings, QueueSettings
from predictor import CandidateRequest
from predictor.prefix_index import PrefixKey

__all__ = ["AdmissionRequest"]


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """One request to admit.

    ``request_class``: the resolved class name (``classes.choose_class``); an unknown name is judged
    as the default class. ``prompt_tokens`` (>= 1): counted or estimated prompt size.
    ``max_tokens``: the client's output cap; ``None`` means the engine's default, the rest of the
    replica's ``max_model_len``. ``expected_output_tokens``: the predicted output length
    (``predictor.OutputLengthPredictor``), ``output_quantile`` the quantile it is.
    ``arrival_s``: when it reached the gateway, on the admission clock (seconds).
    ``deadline_s``: the client's own first-token deadline on the same clock (from the deadline
    header, ``classes.client_deadline_s``), or ``None``; it only ever tightens the class target.
    ``cached_prompt_tokens``: prompt tokens expected to hit the prefix cache. ``tenant``: whose
    request it is (``None``: nobody's). ``choices`` (>= 1): the sequences it decodes (its prompts
    times the body's ``n``), each of ``expected_output_tokens``: forecast together, and priced by
    the tenant's budget (``gateway.admission.budget``).
    ``size_protected``: its prompt-size band of its class is admitted below its share
    (``gateway.admission.size_share``): it may wait in the queue, first, while only the replicas'
    load blocks it. ``size_standing``: for a protected request, its band's admission rate as a
    share of its class's best band's (0-1, ``SizeShares.standing``): the queue takes the most
    starved first. ``fewest_prompt_tokens`` (1 <= it <= ``prompt_tokens``): the lowest plausible
    prompt size when ``prompt_tokens`` is an estimate (``None``: it is exact); whether a replica can
    hold the request at all is judged on it, so an estimate alone never refuses it as too long.
    ``reserve_whole_output``: its tenant's budget reserves its whole output cap (``max_tokens``
    per choice), not the prediction: a response that cannot be stopped part-way
    (``gateway.admission.budget.reserved_output``). ``model``: the model it names, whose
    replica group's token weights its budget prices it with (``None``: not known; the
    budget's weights for no model in particular). ``prefix``: its prompt's leading blocks, to
    look up in each replica's prefix index (``predictor.prefix_index``; ``None``: not indexed,
    ``cached_prompt_tokens`` is then its expected hit everywhere). ``session``: the client session
    it belongs to (``None``: none); ``affinity``: the replica that served that session last, which
    routing prefers (``None``: none). ``exact_output_tokens``: its output per choice when known
    exactly (``ignore_eos`` with ``max_tokens``: the client pinned it to the cap); the forecasts
    of the requests behind it count on it while it runs (``None``: predicted).
    """

    request_id: str
    request_class: str
    prompt_tokens: int
    max_tokens: int | None
    expected_output_tokens: float
    arrival_s: float
    output_quantile: float | None = None
    deadline_s: float | None = None
    cached_prompt_tokens: int = 0
    tenant: str | None = None
    choices: int = 1
    size_protected: bool = False
    size_standing: float = 0.0
    fewest_prompt_tokens: int | None = None
    reserve_whole_output: bool = False
    model: str | None = None
    prefix: PrefixKey | None = field(default=None, repr=False, compare=False)
    session: str | None = None
    affinity: str | None = None
    exact_output_tokens: int | None = None
    _candidate: CandidateRequest | None = field(default=None, init=False, repr=False, compare=False)
    #: Smallest ``max_model_len`` and KV capacity (tokens) a replica needs to hold it at all, at
    #: its fewest plausible prompt tokens.
    min_model_len: int = field(default=0, init=False, repr=False, compare=False)
    min_kv_tokens: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.choices < 1:
            raise ValueError(f"choices must be >= 1, got {self.choices}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        fewest = self.fewest_prompt_tokens
        if fewest is not None and not 1 <= fewest <= self.prompt_tokens:
            raise ValueError(f"fewest_prompt_tokens must be in [1, prompt_tokens], got {fewest}")
        if not (math.isfinite(self.expected_output_tokens) and self.expected_output_tokens >= 0):
            raise ValueError(
                f"expected_output_tokens must be finite and >= 0, got {self.expected_output_tokens}"
            )
        output = self.expected_output_tokens
        if self.max_tokens is not None:
            object.__setattr__(self, "_candidate", self._build(self.max_tokens))
            output = min(output, float(self.max_tokens))
        # A missing cap is the engine's default (the rest of the context): at least one token.
        prompt = self.prompt_tokens if fewest is None else fewest
        object.__setattr__(self, "min_model_len", prompt + (self.max_tokens or 1))
        object.__setattr__(self, "min_kv_tokens", prompt + max(1.0, output) * self.choices)

    def _build(self, max_tokens: int, cached: int | None = None) -> CandidateRequest:
        return CandidateRequest(
            self.prompt_tokens,
            max_tokens,
            self.expected_output_tokens,
            self.output_quantile,
            self.cached_prompt_tokens if cached is None else cached,
            self.choices,
        )

    def candidate(self, max_model_len: int, cached: int | None = None) -> CandidateRequest:
        """The predictor's view of it on a replica with ``max_model_len`` (which fills a missing cap).
        An estimated prompt too long for the replica, whose fewest plausible tokens fit, is
        forecast at the longest prompt the replica would take (what it is if the engine takes it).
        ``cached``: its prefix-cache hit there, in prompt tokens (``None``: ``cached_prompt_tokens``)."""
        if cached is not None and cached != self.cached_prompt_tokens:
            return self._candidate_with(max_model_len, cached)
        fewest = self.fewest_prompt_tokens
        if (
            fewest is not None
            and self.prompt_tokens + (self.max_tokens or 1) > max_model_len >= self.min_model_len
        ):
            prompt = max_model_len - (self.max_tokens or 1)
            return CandidateRequest(
                prompt,
                self.max_tokens or 1,
                self.expected_output_tokens,
                self.output_quantile,
                min(self.cached_prompt_tokens, prompt),
                self.choices,
            )
        if self._candidate is not None:
            return self._candidate
        return self._build(max(1, max_model_len - self.prompt_tokens))

    def _candidate_with(self, max_model_len: int, cached: int) -> CandidateRequest:
        """``candidate`` with a hit of ``cached`` prompt tokens (a replica's own)."""
        base = self.candidate(max_model_len)
        return CandidateRequest(
            base.prompt_tokens,
            base.max_tokens,
            base.expected_output_tokens,
            base.output_quantile,
            min(cached, base.prompt_tokens - 1) if cached > 0 else 0,
            base.sequences,
        )

    def max_tokens_on(self, max_model_len: int) -> int:
        """Its output cap on a replica with ``max_model_len``, in tokens."""
        return self.max_tokens if self.max_tokens is not None else max(1, max_model_len - self.prompt_tokens)

    def fits(self, max_model_len: int, kv_capacity_tokens: int) -> bool:
        """Whether a replica with these limits can hold it at all (else the engine answers 400), at
        its fewest plausible prompt tokens."""
        return max_model_len >= self.min_model_len and kv_capacity_tokens >= self.min_kv_tokens

    def first_token_deadline_s(self, cls: ClassSettings) -> float:
        """Latest acceptable first token, on the admission clock: arrival + TTFT target, or the
        client's deadline when that is earlier (a client can tighten, never loosen)."""
        target = self.arrival_s + cls.ttft_target_s
        return target if self.deadline_s is None else min(target, self.deadline_s)

    def client_bound(self, cls: ClassSettings) -> bool:
        """Whether the client's deadline, not the class target, sets ``first_token_deadline_s``."""
        return self.deadline_s is not None and self.deadline_s < self.arrival_s + cls.ttft_target_s

    def fresh_ttft_budget_s(self, cls: ClassSettings) -> float:
        """TTFT a retry of this request would be allowed, in seconds (target or client deadline)."""
        return self.first_token_deadline_s(cls) - self.arrival_s

    def queue_deadline_s(self, cls: ClassSettings) -> float:
        """Latest time it may still be waiting in Sluice's queue: the earlier of arrival +
        ``max_queue_wait_s`` and its first-token deadline."""
        return min(self.arrival_s + cls.max_queue_wait_s, self.first_token_deadline_s(cls))

    def job_size_s(self, queue: QueueSettings) -> float:
        """Predicted job size for shortest-job-first, in seconds of weighted tokens."""
        output = self.expected_output_tokens
        if self.max_tokens is not None:
            output = min(output, float(self.max_tokens))
        uncached = self.prompt_tokens - min(self.cached_prompt_tokens, self.prompt_tokens - 1)
        return uncached * queue.prompt_token_cost_s + output * queue.output_token_cost_s
