"""``server.workers`` from the command line: ``sluice serve --workers N`` and ``SLUICE_WORKERS``,
the flag winning, and the settings validated again with it (port 0, budgets in memory)."""

from __future__ import annotations

import pytest

from gateway.cli import EXIT_CONFIG, build_parser, main
from gateway.config.load import ConfigError, default_settings, parse_settings
from gateway.config.starter import Source, UsageError, resolve_source, with_workers
from gateway.workers import PARENT_ENV, WORKER_ENV, supervisor_pid, worker_index


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
    settings = parse_settings(_fleet(server={"port": 9000}), "f.yaml")
    assert with_workers(settings, None, "f.yaml") is settings
    assert with_workers(settings, 4, "f.yaml").server.workers == 4
    zero = parse_settings(_fleet(server={"port": 0}), "f.yaml")
    with pytest.raises(ConfigError) as caught:
        with_workers(zero, 2, "f.yaml")
    assert caught.value.path == "f.yaml with --workers 2"
    assert caught.value.problems == [
        "server.port: 0 picks a different free port in each of the 2 workers: give a fixed port (got 0)"
    ]


def test_budgets_in_redis_or_no_limits_allow_workers() -> None:
    key = "sha256:" + "3" * 64
    redis = {"backend": "redis", "redis": {"url": "redis://127.0.0.1:6379/0"}}
    limited = {"tenants": {"t": {"api_keys": [key], "limits": {"max_concurrent": 4}}}}
    assert (
        parse_settings(_fleet(server={"workers": 2}, tenants=limited, limits=redis), "f").server.workers == 2
    )
    unlimited = {"tenants": {"t": {"api_keys": [key]}}}
    assert parse_settings(_fleet(server={"workers": 2}, tenants=unlimited), "f").server.workers == 2


def test_the_embedded_default_with_workers_says_which_key_to_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The demo tenant has limits and the default keeps budgets in memory: refused before anything
    starts, naming the key."""
    assert default_settings().server.workers == 1
    assert main(["serve", "--workers", "2"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "with --workers 2" in err
    assert "limits.backend: memory keeps each of the 2 workers' own budgets" in err


def test_worker_identity_comes_from_the_supervisor_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_ENV, raising=False)
    monkeypatch.setenv(PARENT_ENV, "123")
    assert worker_index() is None
    assert supervisor_pid() is None
    monkeypatch.setenv(WORKER_ENV, "1")
    assert worker_index() == 1
    assert supervisor_pid() == 123
