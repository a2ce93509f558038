"""The keys file reloads with the configuration; ``sluice hash-key``; the embedded demo tenant."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config.load import ConfigError, default_settings, load_settings
from gateway.config.reload import ConfigReloader
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.tenants import DEMO_API_KEY, Authenticator, hash_api_key

WAIT_S = 20.0
OLD_KEY = "sk-keys-file-old-31a7"
NEW_KEY = "sk-keys-file-new-8e02"


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically (a new inode), as editors and secret pipelines do."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "sluice.yaml"
    config.write_text(
        "replicas: [{name: r0, url: 'http://127.0.0.1:8000'}]\n"
        "reload: {watch: true, poll_interval_s: 0.01}\n"
        "tenants:\n"
        "  keys_file: keys.yaml\n"
        "  tenants: {team-a: {}}\n"
    )
    _write(tmp_path / "keys.yaml", f"team-a: ['{hash_api_key(OLD_KEY)}']\n")
    return config


def _tenant_of(settings: Settings, key: str) -> str | None:
    found = Authenticator(settings.tenants).authenticate(f"Bearer {key}")
    return getattr(found, "name", None)


def test_load_settings_reads_the_keys_file_next_to_the_config(tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path))

    assert _tenant_of(settings, OLD_KEY) == "team-a"


def test_a_bad_keys_file_fails_the_whole_load(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _write(tmp_path / "keys.yaml", f"team-a: ['{OLD_KEY}']\n")  # a plaintext key

    with pytest.raises(ConfigError) as err:
        load_settings(config)

    assert err.value.path.endswith("keys.yaml")
    assert OLD_KEY not in str(err.value)


async def test_a_change_to_the_keys_file_alone_reloads(tmp_path: Path) -> None:
    config = _config(tmp_path)
    store = SettingsStore(load_settings(config))
    swapped = asyncio.Event()
    store.subscribe(lambda _old, _new: swapped.set())
    reloader = ConfigReloader(config, store)
    await reloader.start()
    try:
        _write(tmp_path / "keys.yaml", f"team-a: ['{hash_api_key(NEW_KEY)}']\n")
        await asyncio.wait_for(swapped.wait(), WAIT_S)
    finally:
        await reloader.stop()

    assert _tenant_of(store.current, NEW_KEY) == "team-a"
    assert _tenant_of(store.current, OLD_KEY) is None


@pytest.mark.parametrize(
    ("stdin", "code", "out"),
    [
        pytest.param("sk-demo\n", 0, hash_api_key("sk-demo") + "\n", id="trailing-newline"),
        pytest.param("  sk-demo  ", 0, hash_api_key("sk-demo") + "\n", id="surrounding-spaces"),
        pytest.param("sk demo\n", 2, "", id="inner-space-refused"),
        pytest.param("", 2, "", id="empty-refused"),
    ],
)
def test_hash_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: str, code: int, out: str
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))

    assert main(["hash-key"]) == code

    captured = capsys.readouterr()
    assert captured.out == out
    if stdin.strip():
        assert stdin.strip() not in captured.err


def test_the_embedded_default_has_the_demo_tenant() -> None:
    settings = default_settings()

    assert settings.tenants.auth_required
    assert _tenant_of(settings, DEMO_API_KEY) == "demo"
    limits = settings.tenants.tenants["demo"].limits
    # Generous for the README's examples and a demo load.
    assert (limits.tokens_per_minute, limits.requests_per_minute, limits.max_concurrent) == (5e6, 3000.0, 256)
