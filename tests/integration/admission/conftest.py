"""Real processes for the admission tests: an emulated replica and ``sluice serve --config FILE``."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.procs import ROOT, Proc, free_port, python_module

#: Llama-3-8B on H100 with vLLM's --max-num-seqs 4 (a small replica; see the profile's header).
SMALL_PROFILE = ROOT / "tests" / "data" / "profiles" / "llama3-8b-h100-seqs4.yaml"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
#: What an operator who launched that replica would write for it.
SMALL_HARDWARE = {"gpu": "H100-SXM", "model": "Llama-3-8B", "max_num_seqs": 4, "max_num_batched_tokens": 8192}


@dataclass
class Running:
    """A started process and the URL it serves."""

    proc: Proc
    url: str


def start_emulator(profile: Path = SMALL_PROFILE, seed: int = 1) -> Running:
    port = free_port()
    args = python_module(
        "simulator",
        "--profile",
        str(profile),
        "--port",
        str(port),
        "--seed",
        str(seed),
        "--log-level",
        "WARNING",
    )
    proc = Proc(args, name="emulator")
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health", timeout_s=60)
    return Running(proc, url)


def gateway_config(
    replica_url: str, admission: dict[str, Any], *, access_log: bool = False
) -> dict[str, Any]:
    return {
        "server": {"port": free_port()},
        "replicas": [{"name": "emu", "url": replica_url, "hardware": SMALL_HARDWARE}],
        "health": {"interval_s": 1.0, "timeout_s": 0.5},
        "scrape": {"interval_s": 0.5, "timeout_s": 0.5, "window_s": 5.0},
        "logging": {"access_log": access_log, "level": "INFO"},
        "admission": admission,
    }


def start_gateway(tmp_path: Path, config: dict[str, Any]) -> Running:
    """``sluice serve --config`` in its own process; returns once it lists the model."""
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc(python_module("gateway.cli", "serve", "--config", str(path)), name="gateway")
    url = f"http://127.0.0.1:{config['server']['port']}"
    proc.wait_http(f"{url}/readyz", timeout_s=60)
    _wait_for_model(url)
    return Running(proc, url)


def _wait_for_model(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            if json.loads(resp.read())["data"]:
                return
        time.sleep(0.1)
    raise TimeoutError("the gateway listed no model")
