"""The keys file: read with the configuration, validated like ``api_keys`` (every problem at once,
secrets redacted), merged into the tenants so their keys authenticate; a changed file changes keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.load import ConfigError
from gateway.tenants import (
    Authenticator,
    AuthError,
    AuthFailure,
    Tenant,
    TenantsSettings,
    apply_keys_file,
    hash_api_key,
    keys_file_path,
    load_keys_file,
    parse_keys_file,
)

IN_CONFIG = hash_api_key("key-in-config")
FILE_A = hash_api_key("key-a-from-file")
FILE_B = hash_api_key("key-b-from-file")
PLAINTEXT = (
    "looks like a plaintext API key; only hashes are stored: run `sluice hash-key` and put the "
    "sha256:<64 hex digits> it prints here instead (got <redacted>)"
)


def settings(keys_file: str | None = "keys.yaml") -> TenantsSettings:
    return TenantsSettings.model_validate(
        {"keys_file": keys_file, "tenants": {"team-a": {"api_keys": [IN_CONFIG]}, "team-b": {}}}
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


def test_keys_from_the_file_join_the_tenants_and_authenticate(tmp_path: Path) -> None:
    write(tmp_path, f"team-a:\n  - {FILE_A}\nteam-b: ['{FILE_B.upper().replace('SHA256:', 'sha256:')}']\n")
    merged = apply_keys_file(settings(), base_dir=tmp_path)
    assert merged.tenants["team-a"].api_keys == [IN_CONFIG, FILE_A]
    assert merged.tenants["team-b"].api_keys == [FILE_B]
    auth = Authenticator(merged)
    for key, tenant in [
        ("key-in-config", "team-a"),
        ("key-a-from-file", "team-a"),
        ("key-b-from-file", "team-b"),
    ]:
        result = auth.authenticate(f"Bearer {key}")
        assert isinstance(result, Tenant)
        assert result.name == tenant


def test_rewriting_the_file_changes_the_keys_on_the_next_load(tmp_path: Path) -> None:
    path = write(tmp_path, f"team-b: [{FILE_B}]\n")
    before = Authenticator(apply_keys_file(settings(), base_dir=tmp_path))
    path.write_text(f"team-a: [{FILE_B}]\n")  # the key moved to another tenant
    after = Authenticator(apply_keys_file(settings(), base_dir=tmp_path))
    assert [a.authenticate("Bearer key-b-from-file") for a in (before, after)] == [
        before.tenants["team-b"],
        after.tenants["team-a"],
    ]


def test_without_a_keys_file_nothing_changes(tmp_path: Path) -> None:
    plain = settings(None)
    assert apply_keys_file(plain, base_dir=tmp_path) is plain
    assert keys_file_path(plain) is None


@pytest.mark.parametrize(
    ("configured", "base", "expected"),
    [
        pytest.param("keys.yaml", "/etc/sluice", "/etc/sluice/keys.yaml", id="relative-to-config-dir"),
        pytest.param("/run/secrets/keys.yaml", "/etc/sluice", "/run/secrets/keys.yaml", id="absolute"),
        pytest.param("keys.yaml", None, "keys.yaml", id="relative-to-working-dir"),
    ],
)
def test_where_the_keys_file_is(configured: str, base: str | None, expected: str) -> None:
    assert keys_file_path(settings(configured), None if base is None else Path(base)) == Path(expected)


def test_an_empty_file_adds_no_key(tmp_path: Path) -> None:
    write(tmp_path, "# no keys yet\n")
    assert load_keys_file(tmp_path / "keys.yaml", settings()) == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f"team-a: [{FILE_A}, sk-live-secret, 'sha256:00', 7]\n",
            [
                f"team-a.1: {PLAINTEXT}",
                "team-a.2: not a key hash: expected sha256: followed by 64 hex digits (got <redacted>)",
                "team-a.3: should be a key hash string (sha256:<64 hex digits>) (got <redacted>)",
            ],
            id="bad-entries",
        ),
        pytest.param(
            "team-a: sk-live-secret\n",
            ["team-a: should be a list of key hashes (sha256:<hex>) (got <redacted>)"],
            id="not-a-list",
        ),
        pytest.param(
            f"team-c: [{FILE_A}]\nsk-live-secret: team-a\n",
            [
                "team-c: not a configured tenant; did you mean 'team-b'? (got 'team-c')",
                "(entry 2): not a configured tenant (known: team-a, team-b) (got <redacted>)",
            ],
            id="unknown-tenants",
        ),
        pytest.param(
            f"team-b: [{IN_CONFIG}]\n",
            [
                f"team-b.0: key hash already used at tenants.team-a.api_keys.0 in the configuration "
                f"(got '{IN_CONFIG}')"
            ],
            id="hash-already-in-config",
        ),
        pytest.param(
            f"team-a: [{FILE_A}]\nteam-b: [{FILE_B}, {FILE_A}]\n",
            [f"team-b.1: key hash already used at team-a.0 in this file (got '{FILE_A}')"],
            id="hash-twice-in-file",
        ),
        pytest.param(
            "- sk-live-secret\n",
            [
                "(top level): expected a mapping of tenant names to lists of key hashes (sha256:<hex>) "
                "(got <redacted>)"
            ],
            id="not-a-mapping",
        ),
        pytest.param(
            "team-a: [sk-live-secret\n",
            [
                "line 2, column 1: invalid YAML: expected ',' or ']', but got '<stream end>' "
                "(the line is not shown: it may hold a key)"
            ],
            id="bad-yaml",
        ),
    ],
)
def test_every_problem_is_reported_with_secrets_redacted(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        apply_keys_file(settings(), base_dir=tmp_path)
    assert caught.value.path == str(path)
    assert caught.value.problems == expected
    assert "sk-live-secret" not in str(caught.value)


def test_a_missing_keys_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        apply_keys_file(settings(), base_dir=tmp_path)
    assert caught.value.problems == ["file not found"]


def test_parse_already_loaded_data() -> None:
    assert parse_keys_file({"team-b": [FILE_B]}, settings(), "secrets") == {"team-b": [FILE_B]}
    with pytest.raises(ConfigError) as caught:
        parse_keys_file({"team-b": "x"}, settings(), "secrets")
    assert caught.value.path == "secrets"


def test_unlisted_key_stays_unknown(tmp_path: Path) -> None:
    write(tmp_path, f"team-b: [{FILE_B}]\n")
    auth = Authenticator(apply_keys_file(settings(), base_dir=tmp_path))
    assert auth.authenticate("Bearer key-a-from-file") == AuthError(AuthFailure.UNKNOWN)
