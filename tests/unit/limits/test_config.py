"""The limits: section and per-tenant budgets: defaults, every violation, and the built stack."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config.settings import SettingsViolations
from gateway.limits.base import LimiterStats, TenantLimits
from gateway.limits.cache import OverLimitCache
from gateway.limits.config import LimitsSettings, RedisSettings, TenantLimitSettings
from gateway.limits.factory import build_limiter
from gateway.limits.failover import FailoverLimiter
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis import RedisLimiter


def problems(exc: ValidationError) -> list[str]:
    """One line per problem, cross-field violations expanded as ``gateway.config.load`` reports them."""
    lines = []
    for error in exc.errors():
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, SettingsViolations):
            lines += [
                f"{'.'.join(map(str, v.path))}: {v.message} (got {v.value!r})" for v in cause.violations
            ]
        else:
            lines.append(f"{'.'.join(map(str, error['loc']))}: {error['msg']}")
    return lines


def test_defaults() -> None:
    settings = LimitsSettings()
    assert (settings.backend, settings.redis, settings.on_storage_error) == ("memory", None, "fail_open")
    assert (settings.expected_gateways, settings.fallback_share, settings.over_limit_cache) == (1, 1.0, True)
    assert RedisSettings(url="redis://h:6379/0").timeout_s == 0.05


def test_a_retired_key_loads_with_a_warning_naming_what_replaced_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sluice.config"):
        settings = LimitsSettings.model_validate({"retry_backoff_max_s": 30.0, "retry_backoff_s": 2.0})
    assert settings.retry_backoff_s == 2.0
    assert "retry_backoff_max_s" not in settings.model_dump()
    [warning] = [r for r in caplog.records if r.name == "sluice.config"]
    assert "limits.retry_backoff_max_s is no longer used" in warning.getMessage()
    assert "probe_interval_s" in warning.getMessage()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            {"backend": "redis"},
            ["redis: required when backend is 'redis' (got None)"],
            id="redis-section-missing",
        ),
        pytest.param(
            {"probe_interval_s": 30.0},
            ["probe_interval_s: Input should be less than or equal to 5"],
            id="probe-interval-too-long",
        ),
        pytest.param(
            {"probe_interval_s": 0.001},
            ["probe_interval_s: Input should be greater than or equal to 0.01"],
            id="probe-interval-too-short",
        ),
        pytest.param(
            {"backend": "memcached"}, ["backend: Input should be 'memory' or 'redis'"], id="unknown-backend"
        ),
        pytest.param(
            {"expected_gateways": 0},
            ["expected_gateways: Input should be greater than or equal to 1"],
            id="no-gateways",
        ),
        pytest.param({"shadow": True}, ["shadow: Extra inputs are not permitted"], id="unknown-key"),
        pytest.param(
            {"backend": "redis", "redis": {"url": "localhost:6379"}},
            ["redis.url: String should match pattern '^rediss?://\\S+$'"],
            id="url-without-scheme",
        ),
        pytest.param(
            {"backend": "redis", "redis": {"url": "redis://h", "timeout_s": 0}},
            ["redis.timeout_s: Input should be greater than 0"],
            id="zero-timeout",
        ),
        pytest.param(
            {"backend": "redis", "redis": {"url": "redis://h", "key_prefix": "a{b}"}},
            ["redis.key_prefix: String should match pattern '^[A-Za-z0-9_.:-]{1,64}$'"],
            id="prefix-with-hash-tag",
        ),
    ],
)
def test_limits_settings_violations(data: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ValidationError) as caught:
        LimitsSettings.model_validate(data)
    assert problems(caught.value) == expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            {"tokens_per_minute": 0}, ["tokens_per_minute: Input should be greater than 0"], id="zero-rate"
        ),
        pytest.param(
            {"max_concurrent": 0},
            ["max_concurrent: Input should be greater than or equal to 1"],
            id="no-slots",
        ),
        pytest.param(
            {"request_burst": 0.5, "requests_per_minute": 1},
            ["request_burst: Input should be greater than or equal to 1"],
            id="burst-below-one",
        ),
        pytest.param(
            {"token_burst": 10, "request_burst": 2},
            [
                "token_burst: needs tokens_per_minute (a burst without a rate limits nothing) (got 10.0)",
                "request_burst: needs requests_per_minute (a burst without a rate limits nothing) (got 2.0)",
            ],
            id="bursts-without-rates-all-reported",
        ),
        pytest.param(
            {"tokens_per_minute": "100"},
            ["tokens_per_minute: Input should be a valid number"],
            id="string-is-not-a-number",
        ),
    ],
)
def test_tenant_limit_violations(data: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ValidationError) as caught:
        TenantLimitSettings.model_validate(data)
    assert problems(caught.value) == expected


def test_tenant_limits_convert_to_the_limiter_value() -> None:
    settings = TenantLimitSettings(
        tokens_per_minute=1000, requests_per_minute=10, max_concurrent=2, token_burst=500
    )
    assert settings.to_limits() == TenantLimits(
        tokens_per_minute=1000, requests_per_minute=10, max_concurrent=2, token_burst=500
    )
    assert TenantLimitSettings().to_limits() == TenantLimits()


def test_memory_backend_builds_a_memory_limiter() -> None:
    limiter = build_limiter(LimitsSettings(lease_ttl_s=60), stats=LimiterStats())
    assert isinstance(limiter, MemoryLimiter)
    assert limiter.lease_ttl_s == 60


@pytest.mark.parametrize(
    "cache", [pytest.param(True, id="with-cache"), pytest.param(False, id="without-cache")]
)
async def test_redis_backend_builds_the_failover_stack(cache: bool) -> None:
    settings = LimitsSettings.model_validate(
        {
            "backend": "redis",
            "redis": {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.2, "key_prefix": "sl"},
            "on_storage_error": "fail_closed",
            "expected_gateways": 4,
            "over_limit_cache": cache,
        }
    )
    stats = LimiterStats()
    limiter = build_limiter(settings, stats=stats)
    assert isinstance(limiter, FailoverLimiter)
    assert limiter.mode == "fail_closed"
    assert isinstance(limiter.fallback, MemoryLimiter)
    assert limiter.fallback.share == 0.25
    primary = limiter.primary
    if cache:
        assert isinstance(primary, OverLimitCache)
        primary = primary.inner
    assert isinstance(primary, RedisLimiter)
    assert (primary.timeout_s, primary.key_prefix, primary.stats) == (0.2, "sl", stats)
    assert limiter.probe_interval_s == 0.25
    await limiter.close()  # nothing was connected: closing must not fail
