"""YAML sections of the limiter: ``limits:`` (backend, Redis, failure policy) and per-tenant budgets.

``LimitsSettings`` is meant to be mounted as ``Settings.limits``; ``TenantLimitSettings`` is meant
to be embedded in each tenant's entry. Both follow ``gateway.config.settings.Section``: unknown keys
rejected, frozen, strict types, units in the field names.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from gateway.config.section import PositiveSeconds, Section, SettingsViolations, Violation
from gateway.limits.base import TenantLimits

_log = logging.getLogger("sluice.config")

#: Keys the ``limits`` section once had and no longer reads: accepted with a warning, so that a
#: config written for an older gateway still loads. Key -> what replaced it.
RETIRED_KEYS = {
    "retry_backoff_max_s": "Redis is probed every limits.probe_interval_s while it is down; remove the key",
}

PerMinute = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: A cost weight: finite and > 0.
Weight = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class TenantLimitSettings(Section):
    """One tenant's budgets; an absent key means unlimited."""

    tokens_per_minute: Annotated[
        PerMinute | None,
        Field(
            description="Tokens (prompt + output; weighted when limits.token_weights sets weights) the "
            "tenant may use per minute, shared by all gateways; null means unlimited."
        ),
    ] = None
    requests_per_minute: Annotated[
        PerMinute | None, Field(description="Requests the tenant may start per minute; null means unlimited.")
    ] = None
    max_concurrent: Annotated[
        int | None,
        Field(ge=1, description="Requests the tenant may have in flight at once; null means unlimited."),
    ] = None
    token_burst: Annotated[
        PerMinute | None,
        Field(
            description="Token bucket capacity, in the budget's tokens: the most a tenant can spend at once "
            "after being idle; a single request costing more is refused as never admissible. "
            "Default: tokens_per_minute (one minute's worth)."
        ),
    ] = None
    request_burst: Annotated[
        float | None,
        Field(
            ge=1,
            allow_inf_nan=False,
            description="Request bucket capacity, in requests. "
            "Default: requests_per_minute (one minute's worth).",
        ),
    ] = None

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> TenantLimitSettings:
        violations = [
            Violation((burst,), f"needs {rate} (a burst without a rate limits nothing)", getattr(self, burst))
            for burst, rate in (
                ("token_burst", "tokens_per_minute"),
                ("request_burst", "requests_per_minute"),
            )
            if getattr(self, burst) is not None and getattr(self, rate) is None
        ]
        if violations:
            raise SettingsViolations(violations)
        return self

    def to_limits(self) -> TenantLimits:
        """The value the limiter takes."""
        return TenantLimits(
            tokens_per_minute=self.tokens_per_minute,
            requests_per_minute=self.requests_per_minute,
            max_concurrent=self.max_concurrent,
            token_burst=self.token_burst,
            request_burst=self.request_burst,
        )


class TokenWeightSettings(Section):
    """Fixed weights of a tenant's token cost, pinned by the operator: ``{prompt: x, output: y}``."""

    mode: Annotated[
        Literal["fixed"], Field(description="fixed (the default when prompt and output are given).")
    ] = "fixed"
    prompt: Annotated[
        Weight,
        Field(description="Weighted tokens one prompt (prefill) token costs; > 0."),
    ]
    output: Annotated[
        Weight,
        Field(description="Weighted tokens one output (decode) token costs; > 0."),
    ]


class GpuTimeWeightSettings(Section):
    """Opt-in GPU-time pricing: ``{mode: gpu_time}``. A prompt token costs 1 and an output token
    the GPU time of a decode token over a prefill token on the replicas serving the request's
    model, per their step model at a fixed reference operating point (not the live batch), moving
    towards a refit by at most ``max_change_per_minute`` a minute."""

    mode: Annotated[Literal["gpu_time"], Field(description="gpu_time: weights from the step model.")]
    reference_batch_seqs: Annotated[
        int,
        Field(
            ge=1,
            le=4096,
            description="Decode batch (sequences per step) the output token's GPU time is taken at; "
            "capped at each replica's max_num_seqs.",
        ),
    ] = 64
    reference_context_tokens: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000,
            description="Tokens of context each sequence of the reference batch reads, and the "
            "prompt length a prefill token is priced at.",
        ),
    ] = 1024
    max_change_per_minute: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            allow_inf_nan=False,
            description="Largest relative change of an output token's weight per minute (0.1: at most "
            "10 % a minute, compounding); a refit moves the weight towards it at this pace.",
        ),
    ] = 0.1


def _weights_kind(value: Any) -> str:
    """Which weights section a ``token_weights`` value is: ``gpu_time`` or ``fixed``."""
    mode = value.get("mode") if isinstance(value, dict) else getattr(value, "mode", None)
    return "gpu_time" if mode == "gpu_time" else "fixed"


#: ``limits.token_weights``: fixed weights or the GPU-time opt-in, told apart by ``mode``.
WeightSettings = Annotated[
    Annotated[TokenWeightSettings, Tag("fixed")] | Annotated[GpuTimeWeightSettings, Tag("gpu_time")],
    Discriminator(_weights_kind),
]


class RedisSettings(Section):
    """Where the shared budgets live. Restart required for every key."""

    url: Annotated[
        str,
        Field(
            pattern=r"^rediss?://\S+$",
            description="Redis URL, e.g. redis://10.0.0.7:6379/0 (rediss:// for TLS); "
            "with cluster: any node.",
        ),
    ]
    cluster: Annotated[
        bool, Field(description="The URL names a Redis Cluster node; keys are hash-tagged.")
    ] = False
    timeout_s: Annotated[
        PositiveSeconds,
        Field(
            le=10,
            description="Longest a limiter call may take, waiting for a connection included, in seconds; "
            "past it the call counts as a storage failure and on_storage_error decides.",
        ),
    ] = 0.05
    max_connections: Annotated[
        int,
        Field(ge=1, description="Most concurrent Redis calls (and pooled connections, per cluster node)."),
    ] = 64
    key_prefix: Annotated[
        str,
        Field(
            pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
            description="Prefix of every key: <prefix>:{<tenant>}:tokens|requests|leases.",
        ),
    ] = "sluice"


class LimitsSettings(Section):
    """Tenant budgets' storage and what happens when it fails."""

    backend: Annotated[
        Literal["memory", "redis"],
        Field(
            description="memory: budgets kept in this process (one gateway); redis: shared by every gateway. "
            "Restart required."
        ),
    ] = "memory"
    redis: Annotated[RedisSettings | None, Field(description="Required when backend is redis.")] = None
    on_storage_error: Annotated[
        Literal["fail_open", "fail_closed"],
        Field(
            description="When Redis fails or is slower than redis.timeout_s: fail_open answers from local "
            "buckets at this gateway's share (1/expected_gateways) of every budget; fail_closed answers 503."
        ),
    ] = "fail_open"
    expected_gateways: Annotated[
        int, Field(ge=1, description="Gateway replicas sharing the budgets; each falls back to 1/N of them.")
    ] = 1
    retry_backoff_s: Annotated[
        PositiveSeconds,
        Field(description="Retry-After of a fail_closed 503 while Redis is down, in seconds."),
    ] = 1.0
    probe_interval_s: Annotated[
        PositiveSeconds,
        Field(
            ge=0.01,
            le=5,
            description="While Redis is down, a background PING asks it every this many seconds, "
            "whatever the traffic; the first answered marks it up, so service returns within about "
            "one interval of Redis answering. Requests meanwhile never wait on Redis.",
        ),
    ] = 0.25
    lease_ttl_s: Annotated[
        PositiveSeconds,
        Field(
            description="How long an unsettled request holds its concurrency slot, in seconds (frees the "
            "slots of a crashed gateway); should exceed the longest request."
        ),
    ] = 900.0
    token_weights: Annotated[
        WeightSettings | None,
        Field(
            description="What a tenant's token budget counts. null (default): plain tokens, prompt + "
            "output, as OpenAI's TPM does. {prompt: x, output: y}: weighted tokens = x x prompt "
            "tokens + y x output tokens. {mode: gpu_time}: a prompt token 1 and an output token "
            "its GPU time over a prompt token's, per the step model of the replicas serving the "
            "model at a fixed reference batch, changing at most max_change_per_minute a minute."
        ),
    ] = None
    over_limit_cache: Annotated[
        bool,
        Field(description="Answer tenants known to be over a limit from memory until their retry time."),
    ] = True
    ietf_headers: Annotated[
        bool,
        Field(
            description="Also send the IETF RateLimit-Policy and RateLimit fields "
            "(draft-ietf-httpapi-ratelimit-headers-11) beside OpenAI's x-ratelimit-* headers, on every "
            "response of a tenant with limits."
        ),
    ] = False

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        """Drop ``RETIRED_KEYS`` with a warning naming what replaced each."""
        if isinstance(data, dict) and any(key in data for key in RETIRED_KEYS):
            data = dict(data)
            for key, instead in RETIRED_KEYS.items():
                if data.pop(key, None) is not None:
                    _log.warning("limits.%s is no longer used: %s", key, instead)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> LimitsSettings:
        violations: list[Violation] = []
        if self.backend == "redis" and self.redis is None:
            violations.append(Violation(("redis",), "required when backend is 'redis'", None))
        if violations:
            raise SettingsViolations(violations)
        return self

    @property
    def fallback_share(self) -> float:
        """The part of each budget one gateway enforces on its own while Redis is down."""
        return 1.0 / self.expected_gateways
