"""The whole stack as real processes: two emulated replicas and `sluice serve --config FILE`."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.procs import ROOT, Proc, free_port, python_module


@dataclass
class Stack:
    base_url: str
    config_path: Path
    config: dict[str, object]
    replica_ports: dict[str, int]
    gateway: Proc
    model: str

    def write_config(self, config: dict[str, object]) -> None:
        """Replace the config file atomically, as an editor or a ConfigMap update does."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config_path)
        self.config = config

    def get_json(self, path: str, base: str | None = None) -> tuple[int, dict[str, object]]:
        req = urllib.request.Request((base or self.base_url) + path)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def replica_metrics(self, name: str) -> str:
        url = f"http://127.0.0.1:{self.replica_ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())


def _first_model(base: str, timeout_s: float = 20.0, key: str | None = None) -> str:
    """The gateway learns models from its replicas shortly after start: wait for one. ``key``: a
    tenant's API key, which ``/v1/models`` needs when tenants are configured."""
    deadline = time.monotonic() + timeout_s
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(
            urllib.request.Request(base + "/v1/models", headers=headers), timeout=5
        ) as resp:
            data: list[dict[str, object]] = json.loads(resp.read())["data"]
        if data:
            return str(data[0]["id"])
        time.sleep(0.1)
    raise TimeoutError("the gateway listed no model")


def _sluice() -> list[str]:
    exe = shutil.which("sluice") or str(Path(ROOT / ".venv" / "bin" / "sluice"))
    return [exe]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    ports = {"emu-a": free_port(), "emu-b": free_port()}
    replicas: list[Proc] = []
    gateway: Proc | None = None
    try:
        for seed, (name, port) in enumerate(ports.items(), start=1):
            proc = Proc(
                python_module(
                    "simulator", "--profile", "llama3-8b-h100", "--port", str(port), "--seed", str(seed)
                ),
                name=name,
            )
            replicas.append(proc)
        for proc, port in zip(replicas, ports.values(), strict=True):
            proc.wait_http(f"http://127.0.0.1:{port}/health")
        gw_port = free_port()
        config: dict[str, object] = {
            "server": {"host": "127.0.0.1", "port": gw_port},
            "replicas": [{"name": n, "url": f"http://127.0.0.1:{p}"} for n, p in ports.items()],
            "health": {"interval_s": 0.5, "timeout_s": 0.5},
            "reload": {"watch": True, "poll_interval_s": 0.2},
        }
        config_path = tmp / "sluice.yaml"
        config_path.write_text(yaml.safe_dump(config))
        gateway = Proc([*_sluice(), "serve", "--config", str(config_path)], name="gateway")
        base = f"http://127.0.0.1:{gw_port}"
        gateway.wait_http(base + "/readyz")
        model = _first_model(base)
        yield Stack(base, config_path, config, ports, gateway, model)
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in replicas:
            proc.stop()
