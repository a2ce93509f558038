"""``server.workers`` from the command line: ``sluice serve --workers N`` and ``SLUICE_WORKERS``,
the flag winning, and the settings validated again with it (port 0, Redis for the ledger); a
worker's identity and its share of budgets kept in memory."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser
from gateway.config.load import ConfigError, default_settings, parse_settings
from gateway.config.starter import Source, UsageError, resolve_source, with_workers
from gateway.workers import COUNT_ENV, PARENT_ENV, WORKER_ENV, supervisor_pid, worker_count, worker_index


def _source(argv: list[str], env: dict[str, str] | None = None) -> Source:
    return resolve_source(build_parser().parse_args(argv), env or {})


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        pytest.param(["serve"], {}, None, id="neither: the configuration's"),
        pytest.param(["serve", "--workers", "3"], {}, 3, id="flag"),
        pytest.param(["serve"], {"SLUICE_WORKERS": "2"}, 2, id="environment"),
        pytest.param(["serve", "--workers", "4"], {"SLUICE_WORKERS": "2"}, 4, id="flag wins"),
        pytest.param(["serve"], {"SLUICE_WORKERS": " "}, None, id="blank variable"),
    ],
)
def test_workers_come_from_the_flag_or_the_environment(
    argv: list[str], env: dict[str, str], expected: int | None
) -> None:
    assert _source(argv, env).workers == expected


def test_a_workers_variable_that_is_no_number_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"SLUICE_WORKERS='two': expected a whole number"):
        _source(["serve"], {"SLUICE_WORKERS": "two"})


def _fleet(**sections: object) -> dict[str, object]:
    return {"replicas": [{"name": "r0", "url": "http://127.0.0.1:8000"}], **sections}


def test_with_workers_sets_the_key_and_validates_again() -> None:
    redis = {"redis": {"url": "redis://127.0.0.1:6379/0"}}
    settings = parse_settings(_fleet(server={"port": 9000}, limits=redis), "f.yaml")
    assert with_workers(settings, None, "f.yaml") is settings
    assert with_workers(settings, 4, "f.yaml").server.workers == 4
    zero = parse_settings(_fleet(server={"port": 0}, limits=redis), "f.yaml")
    with pytest.raises(ConfigError) as caught:
        with_workers(zero, 2, "f.yaml")
    assert caught.value.path == "f.yaml with --workers 2"
    assert caught.value.problems == [
        "server.port: 0 picks a different free port in each of the 2 workers: give a fixed port (got 0)"
    ]


def test_workers_need_redis_and_keep_budgets_in_memory_or_there() -> None:
    """Workers share their view of the replicas through the ledger, on ``limits.redis``: without
    it, more than one worker is a configuration error (the embedded default's included). With
    it, budgets may stay in memory (each worker its share, ``gateway.limits.factory``) or go to
    Redis (one budget)."""
    key = "sha256:" + "3" * 64
    url = {"url": "redis://127.0.0.1:6379/0"}
    limited = {"tenants": {"t": {"api_keys": [key], "limits": {"max_concurrent": 4}}}}
    for limits in ({"redis": url}, {"backend": "redis", "redis": url}):
        settings = parse_settings(_fleet(server={"workers": 2}, tenants=limited, limits=limits), "f")
        assert settings.server.workers == 2
        assert settings.limited_tenants() == ["t"]
    with pytest.raises(ConfigError) as caught:
        parse_settings(_fleet(server={"workers": 2}, tenants=limited), "f")
    assert "server.workers: 2 workers need limits.redis" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        with_workers(default_settings(), 2, "embedded default")
    assert "server.workers: 2 workers need limits.redis" in str(caught.value)


def test_a_worker_keeps_its_share_of_budgets_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.limits.base import LimiterStats
    from gateway.limits.config import LimitsSettings
    from gateway.limits.factory import build_limiter
    from gateway.limits.memory import MemoryLimiter

    monkeypatch.setenv(WORKER_ENV, "0")
    monkeypatch.setenv(COUNT_ENV, "4")
    assert worker_count() == 4
    limiter = build_limiter(LimitsSettings(), stats=LimiterStats(), memory_share=1.0 / worker_count())
    assert isinstance(limiter, MemoryLimiter)
    assert limiter.share == 0.25


def test_worker_identity_comes_from_the_supervisor_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_ENV, raising=False)
    monkeypatch.setenv(PARENT_ENV, "123")
    monkeypatch.setenv(COUNT_ENV, "3")
    assert worker_index() is None
    assert supervisor_pid() is None
    assert worker_count() == 1
    monkeypatch.setenv(WORKER_ENV, "1")
    assert worker_index() == 1
    assert supervisor_pid() == 123
    assert worker_count() == 3
