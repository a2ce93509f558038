"""`sluice serve --replica URL` and `sluice config`: options, their environment variables, the
loopback guard, replica names, and configurations printed as YAML loading back unchanged.

No replica is needed: the options are checked before any replica is asked, and the one test that
asks one names a closed port (``discover`` reports it unreachable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import EXIT_CONFIG, EXIT_OK, build_parser, main
from gateway.config.load import ConfigError, default_settings, load_settings
from gateway.config.settings import Settings
from gateway.config.starter import (
    Source,
    UsageError,
    command_line_settings,
    effective_yaml,
    parse_listen,
    resolve_source,
    starter_yaml,
)
from gateway.replicas.discover import replica_names

ROOT = Path(__file__).resolve().parents[3]
#: A port nothing listens on (tcpmux, never served here): connecting is refused at once.
CLOSED = "http://127.0.0.1:1"


def _source(argv: list[str], env: dict[str, str] | None = None) -> Source:
    return resolve_source(build_parser().parse_args(argv), env or {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:9000", ("0.0.0.0", 9000)),
        ("gateway.internal:80", ("gateway.internal", 80)),
        (":9000", ("127.0.0.1", 9000)),
        ("10.0.0.5", ("10.0.0.5", 8080)),
        ("[::]:9000", ("::", 9000)),
        ("[::1]", ("::1", 8080)),
        ("::1", ("::1", 8080)),
    ],
)
def test_listen_forms(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


def test_listen_port_must_be_a_number() -> None:
    with pytest.raises(ValueError, match="numeric port"):
        parse_listen("0.0.0.0:http")


def test_replicas_from_flags_or_environment() -> None:
    from_flags = _source(["serve", "--replica", "http://a:8000", "--replica", "http://b:8000"])
    env = {"SLUICE_REPLICAS": "http://a:8000, http://b:8000", "SLUICE_LISTEN": "0.0.0.0:9000"}
    env |= {"SLUICE_DEMO_TENANT": "yes", "SLUICE_ALLOW_UNAUTHENTICATED": "1"}
    env |= {"SLUICE_REPLICA_API_KEY_ENV": "VLLM_KEY"}
    from_env = _source(["serve"], env)

    assert from_flags == Source(replicas=("http://a:8000", "http://b:8000"))
    assert from_env == Source(
        replicas=("http://a:8000", "http://b:8000"),
        listen="0.0.0.0:9000",
        demo_tenant=True,
        allow_unauthenticated=True,
        replica_api_key_env="VLLM_KEY",
    )


def test_a_flag_wins_over_its_variable() -> None:
    env = {"SLUICE_REPLICAS": "http://env:8000", "SLUICE_LISTEN": "0.0.0.0:1"}
    source = _source(["config", "show", "--replica", "http://flag:8000", "--listen", ":9"], env)

    assert source == Source(replicas=("http://flag:8000",), listen=":9")


def test_config_file_from_the_environment() -> None:
    assert _source(["serve"], {"SLUICE_CONFIG": "/etc/sluice/sluice.yaml"}) == Source(
        config=Path("/etc/sluice/sluice.yaml")
    )


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve", "--config", "a.yaml", "--replica", "http://a:1"], {}, "either --config"),
        (["serve", "--replica", "http://a:1"], {"SLUICE_CONFIG": "a.yaml"}, "either --config"),
        (["serve", "--listen", ":9000"], {}, "--listen: only with --replica"),
        (["serve", "--config", "a.yaml", "--demo-tenant"], {}, "--demo-tenant: only with --replica"),
        (["serve"], {"SLUICE_ALLOW_UNAUTHENTICATED": "true"}, "--allow-unauthenticated: only with"),
        (["serve", "--replica-api-key-env", "K"], {}, "--replica-api-key-env: only with --replica"),
        (["serve", "--replica", "http://a:1"], {"SLUICE_DEMO_TENANT": "maybe"}, "SLUICE_DEMO_TENANT='maybe'"),
    ],
)
def test_options_that_do_not_go_together(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("[", r"\[")):
        _source(argv, env)


def test_usage_error_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--demo-tenant"]) == EXIT_CONFIG

    err = capsys.readouterr().err
    assert err.startswith("sluice serve: --demo-tenant: only with --replica")
    assert err.count("\n") == 1


def test_serving_beyond_loopback_without_tenants_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # Refused before any replica is asked: the URL's port is closed and would only be logged.
    code = main(["serve", "--replica", CLOSED, "--listen", "0.0.0.0:0"])

    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert err.startswith("command line: 1 problem in configuration\n  server.host: no tenant is configured")
    assert "--allow-unauthenticated" in err


def test_bad_replica_url_and_listen_are_configuration_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--replica", "localhost:8000"]) == EXIT_CONFIG
    assert "replicas.0.url:" in capsys.readouterr().err
    assert main(["config", "show", "--replica", CLOSED, "--listen", "0.0.0.0:x"]) == EXIT_CONFIG
    assert "--listen: expected HOST:PORT with a numeric port" in capsys.readouterr().err


def test_replica_key_variable_must_be_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLUICE_TEST_UNSET_KEY", raising=False)
    assert (
        main(["config", "show", "--replica", CLOSED, "--replica-api-key-env", "SLUICE_TEST_UNSET_KEY"]) == 2
    )
    assert (
        "replicas.0.api_key_env: names an environment variable that is unset or empty"
        in capsys.readouterr().err
    )

    monkeypatch.setenv("SLUICE_TEST_UNSET_KEY", "r-secret")
    assert (
        main(["config", "show", "--replica", CLOSED, "--replica-api-key-env", "SLUICE_TEST_UNSET_KEY"]) == 0
    )
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["replicas"][0]["api_key_env"] == "SLUICE_TEST_UNSET_KEY"
    assert "r-secret" not in out


def test_config_show_of_an_unreachable_replica_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["config", "show", "--replica", CLOSED, "--listen", "0.0.0.0:9000", "--allow-unauthenticated"]
    )

    out, err = capsys.readouterr()
    assert code == EXIT_OK
    shown = yaml.safe_load(out)
    assert shown["server"]["host"] == "0.0.0.0"
    assert shown["server"]["allow_unauthenticated"] is True
    assert shown["replicas"][0]["url"] == CLOSED
    assert shown["replicas"][0]["backend"] == "auto"  # detected once it answers
    assert shown["tenants"]["tenants"] == {}
    assert "not reachable now" in err


def test_demo_tenant_is_off_unless_asked() -> None:
    replicas = [{"name": "a", "url": "http://10.0.0.5:8000"}]

    assert command_line_settings(replicas).authenticates_no_one
    with_demo = command_line_settings(replicas, demo_tenant=True, listen=("0.0.0.0", 8080))
    assert list(with_demo.tenants.tenants) == ["demo"]
    assert with_demo.server.host == "0.0.0.0"


def test_command_line_problems_are_named_as_such() -> None:
    with pytest.raises(ConfigError) as caught:
        command_line_settings([{"name": "a", "url": "http://a:1"}], listen=("127.0.0.1", 70000))

    assert caught.value.path == "command line"
    assert caught.value.problems[0].startswith("server.port:")


@pytest.mark.parametrize(
    ("urls", "names"),
    [
        (["http://vllm-a:8000", "http://vllm-b:8000"], ["vllm-a", "vllm-b"]),
        (["http://10.0.0.5:8000", "http://10.0.0.5:8001"], ["10.0.0.5-8000", "10.0.0.5-8001"]),
        (["http://h:8000/a", "http://h:8000/b"], ["h-8000-0", "h-8000-1"]),
        (["http://[::1]:8000"], ["1"]),
        (["https://gpu.example.com"], ["gpu.example.com"]),
    ],
)
def test_replica_names_are_distinct_and_valid(urls: list[str], names: list[str]) -> None:
    assert replica_names(urls) == names
    command_line_settings([{"name": n, "url": u} for n, u in zip(names, urls, strict=True)])


def _settings_cases() -> list[Settings]:
    replicas: list[dict[str, Any]] = [
        {"name": "a", "url": "http://10.0.0.5:8000", "hardware": {"model": "Llama-3-8B"}},
        {"name": "b", "url": "http://10.0.0.6:8000/", "backend": "auto"},
    ]
    return [
        default_settings(),
        command_line_settings(replicas),
        command_line_settings(replicas, demo_tenant=True, listen=("0.0.0.0", 9000)),
        load_settings(ROOT / "config" / "sluice.example.yaml"),
    ]


@pytest.mark.parametrize("settings", _settings_cases(), ids=["embedded", "replicas", "demo", "example"])
@pytest.mark.parametrize("render", [effective_yaml, starter_yaml], ids=["show", "init"])
def test_printed_configuration_loads_back_unchanged(
    settings: Settings, render: object, tmp_path: Path
) -> None:
    assert callable(render)
    path = tmp_path / "sluice.yaml"
    path.write_text(render(settings), encoding="utf-8")

    assert load_settings(path) == settings


@pytest.mark.parametrize("render", [effective_yaml, starter_yaml], ids=["show", "init"])
def test_keys_from_a_keys_file_are_printed_inline(render: object, tmp_path: Path) -> None:
    assert callable(render)
    a_hash, b_hash = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    (tmp_path / "keys.yaml").write_text(f"team: ['{b_hash}']\n", encoding="utf-8")
    config = {
        "replicas": [{"name": "a", "url": "http://10.0.0.5:8000"}],
        "tenants": {"keys_file": "keys.yaml", "tenants": {"team": {"api_keys": [a_hash]}}},
    }
    (tmp_path / "sluice.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    settings = load_settings(tmp_path / "sluice.yaml")
    printed = tmp_path / "printed" / "sluice.yaml"
    printed.parent.mkdir()
    printed.write_text(render(settings), encoding="utf-8")

    again = load_settings(printed)
    assert again.tenants.tenants == settings.tenants.tenants
    assert sorted(again.tenants.tenants["team"].api_keys) == sorted([a_hash, b_hash])
    assert again.tenants.keys_file is None


def test_starter_yaml_holds_only_what_differs_from_the_defaults() -> None:
    settings = command_line_settings([{"name": "a", "url": "http://10.0.0.5:8000"}])

    text = starter_yaml(settings, ["Replica a (http://10.0.0.5:8000): vllm, serving m (max_model_len 8192)."])

    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert any("No tenant is configured" in line for line in comments)
    assert any("max_model_len 8192" in line for line in comments)
    assert all(len(line) <= 100 for line in comments)
    assert yaml.safe_load(text) == {"replicas": [{"name": "a", "url": "http://10.0.0.5:8000"}]}
