"""The ``admission:`` section: request classes and their targets, the queue, Retry-After, shadow mode.

Pydantic v2 models in the house style (``gateway.config.settings.Section``: unknown keys rejected, frozen,
strict types). Cross-field rules raise ``SettingsViolations`` listing every broken rule at once with
a path relative to ``admission``. Units are in the field names (``_s`` seconds, ``_tokens``);
fractions are plain floats in the stated range.

Times: a class's ``ttft_target_s`` counts from the request's arrival at the gateway, so time spent
in Sluice's queue is part of it (that is what a client and the goodput benchmark measure).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from gateway.admission.classes_config import (
    INTERACTIVE_STALL_BUDGET_HORIZON,
    ClassSettings,
    Fraction,
    SizeFairnessSettings,
    batch_class,
    interactive_class,
)
from gateway.config.section import Name, PositiveSeconds, Section, SettingsViolations, Violation, not_above

__all__ = [
    "INTERACTIVE_STALL_BUDGET_HORIZON",
    "AdmissionSettings",
    "AttainmentSettings",
    "ClassSettings",
    "ConcurrencyCapSettings",
    "HeaderSettings",
    "PrefixCacheSettings",
    "QueueSettings",
    "RetryAfterSettings",
    "SaturationSettings",
    "ShadowSettings",
    "SizeFairnessSettings",
]

#: An HTTP header name as Sluice reads it: lower-case token characters (RFC 9110 ``token``).
HeaderName = Annotated[str, Field(pattern=r"^[a-z0-9!#$%&'*+.^_`|~-]+$")]

#: Largest Retry-After Sluice ever sends, in seconds: the ``openai`` SDKs up to v2.51 ignore larger
#: values and fall back to their own short backoff (math.md §8).
RETRY_AFTER_CAP_S = 60.0


class HeaderSettings(Section):
    """Request headers a client may use to steer admission (names in lower case)."""

    request_class: Annotated[
        HeaderName,
        Field(description="Header naming the request's class; honoured only for classes the tenant may use."),
    ] = "x-sluice-class"
    deadline_ms: Annotated[
        HeaderName,
        Field(
            description="Header giving the client's own first-token deadline, in milliseconds after "
            "arrival; it can only tighten the class's TTFT target, never loosen it."
        ),
    ] = "x-sluice-deadline-ms"


class ShadowSettings(Section):
    """Rules run in shadow mode: decided, counted and logged, but every request is admitted anyway.

    A rule in shadow never rejects or queues; the decision says what it would have done
    (``enforced`` False) and names the replica the request goes to instead.
    """

    slo: Annotated[
        bool, Field(description="Shadow the TTFT/TPOT targets and deadlines (and the queue they feed).")
    ] = False
    protect_streams: Annotated[
        bool,
        Field(description="Shadow the rule that newcomers keep running streams within their TPOT targets."),
    ] = False
    batch_isolation: Annotated[
        bool, Field(description="Shadow the KV/slot shares and the yield-to-more-important-classes rule.")
    ] = False
    prompt_size: Annotated[
        bool,
        Field(description="Shadow the per-class max_prompt_tokens limit (max_model_len is always enforced)."),
    ] = False


class RetryAfterSettings(Section):
    """How Retry-After is derived from the forecast and spread."""

    jitter_fraction: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="Spread added to each Retry-After: the delay is drawn uniformly from "
            "[d, d x (1 + jitter_fraction)], d the predicted drain time, so clients rejected together "
            "come back apart.",
        ),
    ] = 0.5
    min_s: Annotated[
        float, Field(gt=0, le=RETRY_AFTER_CAP_S, description="Smallest delay sent, in seconds.")
    ] = 0.1
    max_s: Annotated[
        float,
        Field(
            gt=0,
            le=RETRY_AFTER_CAP_S,
            description="Largest delay sent, in seconds (at most 60: clients ignore or refuse larger ones).",
        ),
    ] = RETRY_AFTER_CAP_S
    no_replica_s: Annotated[
        PositiveSeconds,
        Field(description="Delay suggested with a 503 when no replica is healthy, in seconds (jittered)."),
    ] = 2.0

    @model_validator(mode="after")
    def _min_below_max(self) -> RetryAfterSettings:
        if found := not_above(self, "min_s", "max_s"):
            raise SettingsViolations(found)
        return self


class QueueSettings(Section):
    """Sluice's queue: shortest predicted job first within a priority, with aging."""

    aging_rate: Annotated[
        float,
        Field(
            ge=0,
            description="Seconds of predicted job size forgiven per second waited (dimensionless): a "
            "job's sort key is size - aging_rate x wait, so a long job overtakes newer short ones.",
        ),
    ] = 1.0
    reserve_after_s: Annotated[
        PositiveSeconds | None,
        Field(
            description="Waiting time, in seconds, after which a request that still cannot be placed "
            "holds back every request of its priority and below (queued or new) until it can: without "
            "it, smaller requests that fit could keep a large one out forever. null = never hold back."
        ),
    ] = 5.0
    prompt_token_cost_s: Annotated[
        float,
        Field(
            ge=0, description="Job size per prompt token, in seconds (default: Llama-3-8B prefill on H100)."
        ),
    ] = 3.0e-5
    output_token_cost_s: Annotated[
        float,
        Field(
            ge=0,
            description="Job size per predicted output token, in seconds (a decode slot's share of a step).",
        ),
    ] = 1.0e-4
    max_examined: Annotated[
        int,
        Field(
            ge=1,
            description="Most queued requests re-forecast per re-evaluation (bounds the work per event; "
            "hard deadlines are checked for every entry regardless).",
        ),
    ] = 256
    fairness: Annotated[
        Literal["tokens", "requests"],
        Field(
            description="What the tenants' fair share counts when several wait: 'tokens' (prompt and "
            "output tokens, counted as the tenants' budgets count them, limits.token_weights: plain by "
            "default, a share of GPU time with mode gpu_time) or 'requests' (every request counts 1, "
            "whatever its size: a tenant sending long prompts gets most of the GPU).",
        ),
    ] = "tokens"


class ConcurrencyCapSettings(Section):
    """``policy: concurrency_cap``: at most ``max_in_flight`` of Sluice's requests per replica; the
    rest wait in Sluice's queue, first in first out, at most ``queue_ttl_s`` each."""

    max_in_flight: Annotated[
        int,
        Field(
            ge=1,
            description="Most of Sluice's requests in flight on one replica (requests); more wait in the "
            "queue (at most each class's queue_capacity; full -> 429 overloaded).",
        ),
    ] = 64
    queue_ttl_s: Annotated[
        PositiveSeconds,
        Field(
            description="Longest a request waits in the queue, in seconds from its arrival; then it is "
            "refused (429 deadline_exceeded). The class targets do not apply under this policy."
        ),
    ] = 2.0


class SaturationSettings(Section):
    """``policy: saturation``: shed load when every replica is saturated (the Kubernetes Gateway API
    Inference Extension's detector): waiting queue above ``queue_threshold`` or KV-cache use above
    ``kv_threshold``, or metrics stale."""

    queue_threshold: Annotated[
        int,
        Field(
            ge=0,
            description="A replica with more requests than this in its engine's waiting queue is saturated.",
        ),
    ] = 5
    kv_threshold: Annotated[
        Fraction,
        Field(
            description="A replica whose KV-cache use (a fraction of its capacity, (0, 1]) is above this "
            "is saturated."
        ),
    ] = 0.8


class AttainmentSettings(Section):
    """The attainment controller (``gateway.admission.attainment``): per class and replica, the
    forecast margin moved to hold the class's ``attainment_target`` over a sliding window."""

    enabled: Annotated[
        bool,
        Field(
            description="Move the margins (false: every margin is forecast_margin; attainment is still "
            "measured and shown)."
        ),
    ] = True
    window_requests: Annotated[
        int, Field(ge=1, description="Most outcomes (ended admitted requests) kept per class and replica.")
    ] = 200
    window_s: Annotated[
        PositiveSeconds,
        Field(
            description="Oldest outcome kept, in seconds after it ended; also how long a refusal lets "
            "the margin loosen, and the quiet time after which it decays."
        ),
    ] = 60.0
    min_samples: Annotated[
        int,
        Field(
            ge=1,
            description="Outcomes of requests admitted since the margin last moved needed before it "
            "moves again.",
        ),
    ] = 20
    confidence: Annotated[
        float,
        Field(
            ge=0.5,
            lt=1,
            description="One-sided confidence of the attainment's Wilson interval: the margin tightens "
            "only when the interval's upper end is below target + deadband, loosens only when its lower "
            "end is at or above the target.",
        ),
    ] = 0.8
    deadband: Annotated[
        float,
        Field(
            ge=0,
            lt=1,
            description="Room to spare, a share of requests: the margin aims at target + deadband; it "
            "loosens only while the measured attainment is at least that, and tightens when it is "
            "clearly below it.",
        ),
    ] = 0.0
    gain: Annotated[
        float,
        Field(
            gt=0,
            description="Step per unit of attainment error: the multiplier 1 + margin changes by "
            "gain x |target - attainment| (a fraction of itself), at most max_step.",
        ),
    ] = 2.0
    max_step: Annotated[
        float,
        Field(gt=0, le=1, description="Largest change of the multiplier 1 + margin in one move, a fraction."),
    ] = 0.25
    min_margin: Annotated[
        float,
        Field(ge=0, description="Floor of the margin (a fraction); forecast_margin if that is lower."),
    ] = 0.0
    max_margin: Annotated[
        float,
        Field(gt=0, description="Cap of the margin (a fraction); forecast_margin if that is higher."),
    ] = 3.0
    decay_half_life_s: Annotated[
        PositiveSeconds,
        Field(
            description="Half-life, in seconds, of the margin's way back to forecast_margin (in the log "
            "of 1 + margin) while a class and replica have had no outcome for window_s and the class is "
            "refused there (an idle spell keeps the margin)."
        ),
    ] = 30.0

    @model_validator(mode="after")
    def _floor_below_cap(self) -> AttainmentSettings:
        if found := not_above(self, "min_margin", "max_margin"):
            raise SettingsViolations(found)
        return self


class PrefixCacheSettings(Section):
    """Prefix-cache awareness (``gateway.admission.prefix``): per replica, which prompt prefixes
    Sluice sent there recently, so forecasts price only the uncached part of a prompt and routing
    weighs the hits a replica offers against its load."""

    enabled: Annotated[
        bool,
        Field(
            description="Index the prompt prefixes sent to each replica and forecast TTFT from the part "
            "expected not to hit its prefix cache. Turn off for replicas started without prefix caching "
            "(vLLM --no-enable-prefix-caching), or to route by load alone."
        ),
    ] = True
    block_bytes: Annotated[
        int,
        Field(
            ge=16,
            le=65536,
            description="Bytes of prompt text per indexed block (about 4 bytes a token in English): smaller "
            "blocks find shorter shared prefixes and cost more hashing.",
        ),
    ] = 256
    max_blocks: Annotated[
        int,
        Field(
            ge=1, le=1_000_000, description="Most blocks indexed per prompt; a longer prompt's tail is not."
        ),
    ] = 4096
    hit_weight: Annotated[
        float,
        Field(
            ge=0,
            le=10,
            description="How much an expected cache hit counts in routing: among replicas where a request "
            "meets its targets, it goes to the one with the most slack plus hit_weight times the share "
            "of its prompt expected to be cached there (slack is a fraction of the targets). 0: by slack "
            "and load alone; larger values keep shared prefixes together at a larger load imbalance.",
        ),
    ] = 0.5
    session_header: Annotated[
        HeaderName | None,
        Field(
            description="Header naming a client session (e.g. x-session-id): a session's requests prefer "
            "the replica that served it last, as if their whole prompt were cached there (hit_weight), "
            "where they meet their targets. None: off."
        ),
    ] = None
    session_from_user: Annotated[
        bool,
        Field(description="Use the body's OpenAI `user` field as the session when the header is absent."),
    ] = False
    max_sessions: Annotated[
        int, Field(ge=1, description="Most sessions remembered (least recently used forgotten first).")
    ] = 100_000


class AdmissionSettings(Section):
    """SLO-aware admission: classes, routing by slack, the queue, Retry-After, shadow mode."""

    policy: Annotated[
        Literal["slo", "admit_all", "concurrency_cap", "saturation", "none"],
        Field(
            description="Admission policy (gateway.admission.policies): `slo` admits what will meet its "
            "targets; `admit_all` routes by slack but admits everything; `concurrency_cap` caps requests "
            "per replica with a FIFO queue (see concurrency_cap); `saturation` refuses when every replica "
            "is saturated (see saturation); `none` sends everything to the least busy replica."
        ),
    ] = "slo"
    concurrency_cap: Annotated[
        ConcurrencyCapSettings, Field(description="Knobs of `policy: concurrency_cap` (ignored otherwise).")
    ] = ConcurrencyCapSettings()
    saturation: Annotated[
        SaturationSettings, Field(description="Knobs of `policy: saturation` (ignored otherwise).")
    ] = SaturationSettings()
    classes: Annotated[
        dict[Name, ClassSettings],
        Field(description="Request classes by name; defaults: `interactive` and `batch`."),
    ] = Field(default_factory=lambda: {"interactive": interactive_class(), "batch": batch_class()})
    default_class: Annotated[
        Name, Field(description="Class of a request that names none (and whose tenant sets none).")
    ] = "interactive"
    headers: Annotated[HeaderSettings, Field(description="Headers clients may use.")] = HeaderSettings()
    shadow: Annotated[ShadowSettings, Field(description="Rules run in shadow mode.")] = ShadowSettings()
    expose_prediction_headers: Annotated[
        bool,
        Field(
            description="Add x-sluice-predicted-ttft-ms, x-sluice-predicted-tpot-ms and x-sluice-admission "
            "to every response, admitted or not."
        ),
    ] = True
    retry_after: Annotated[RetryAfterSettings, Field(description="Retry-After derivation.")] = (
        RetryAfterSettings()
    )
    queue: Annotated[QueueSettings, Field(description="Sluice's queue.")] = QueueSettings()
    forecast_margin: Annotated[
        float,
        Field(
            ge=0,
            description="Safety margin on every forecast: predicted TTFT, TPOT and inflicted TPOT are "
            "multiplied by (1 + forecast_margin) before they are held against the targets, so that the "
            "predictor's errors (about +10 % at the 90th percentile on the emulator) do not push "
            "admitted requests past them. 0 = trust the forecast as it is.",
        ),
    ] = 0.15
    attainment: Annotated[
        AttainmentSettings,
        Field(description="The controller that moves forecast_margin per class and replica."),
    ] = AttainmentSettings()
    stale_margin: Annotated[
        float,
        Field(
            ge=0,
            description="Safety margin for replicas whose metrics are stale: their predicted TTFT, TPOT "
            "and inflicted TPOT are multiplied by (1 + stale_margin), on top of forecast_margin.",
        ),
    ] = 0.5
    yield_margin: Annotated[
        float,
        Field(
            ge=0,
            lt=1,
            description="Share of a protected class's targets kept free by classes that yield to it: "
            "its probe must be predicted within (1 - yield_margin) x each target.",
        ),
    ] = 0.2
    prefix_cache: Annotated[
        PrefixCacheSettings,
        Field(description="Prefix-cache-aware forecasts and routing."),
    ] = PrefixCacheSettings()
    overdue_ttft: Annotated[
        bool,
        Field(
            description="Add to a newcomer's forecast TTFT on a replica the longest that one of Sluice's "
            "streamed requests there has waited for its first token past the TTFT admission held it to "
            "(the queue runs that far behind its forecasts now). Reacts within a view rebuild, keeps no "
            "state. Fewer misses as an overload begins, fewer long prompts admitted under it "
            "(docs/admission.md).",
        ),
    ] = False
    unmodelled_max_in_flight: Annotated[
        int,
        Field(
            ge=0,
            description="Requests Sluice may have in flight on a healthy replica with no step model yet "
            "(unknown hardware, not calibrated); it gets traffic only when no modelled replica can "
            "take the request. 0 = never use such replicas.",
        ),
    ] = 4

    @model_validator(mode="after")
    def _classes_are_consistent(self) -> AdmissionSettings:
        violations = [*self._default_class_exists(), *self._yields_are_valid()]
        if violations:
            raise SettingsViolations(violations)
        return self

    def _default_class_exists(self) -> list[Violation]:
        if not self.classes:
            return [Violation(("classes",), "at least one class is required", {})]
        if self.default_class in self.classes:
            return []
        known = ", ".join(sorted(self.classes))
        return [Violation(("default_class",), f"not a configured class (known: {known})", self.default_class)]

    def _yields_are_valid(self) -> list[Violation]:
        """Every ``yields_to`` entry names another, strictly more important class (so no cycles)."""
        found: list[Violation] = []
        for name, cls in self.classes.items():
            for index, other in enumerate(cls.yields_to):
                path = ("classes", name, "yields_to", index)
                target = self.classes.get(other)
                if other == name:
                    found.append(Violation(path, "a class cannot yield to itself", other))
                elif target is None:
                    found.append(Violation(path, "not a configured class", other))
                elif target.priority >= cls.priority:
                    message = (
                        f"must name a more important class (lower priority than {cls.priority}), "
                        f"but its priority is {target.priority}"
                    )
                    found.append(Violation(path, message, other))
        return found

    def class_settings(self, name: str) -> ClassSettings:
        """The named class, or the default class when ``name`` is not configured."""
        return self.classes.get(name) or self.classes[self.default_class]

    def tightest_tpot_target_s(self) -> float:
        """The smallest TPOT target of any class, in seconds (sizes the decode slots)."""
        return min(c.tpot_target_s for c in self.classes.values())
