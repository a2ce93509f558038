"""The admin listener of a real `sluice serve --config FILE` process (with a real emulated replica
it starts itself): the public listener hides the admin routes, the admin listener serves them
behind the token, a real Prometheus scrapes it with `authorization: credentials_file` (as
deploy/prometheus/prometheus.yml shows), the token rotates on reload while the address needs a
restart, and a taken admin port stops `sluice serve` with a message naming it.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.stack.conftest import _sluice
from tests.observability.prometheus import tool
from tests.support.procs import Proc, free_port, port_is_open

pytestmark = pytest.mark.timeout(180)

TOKEN = "sluice-admin-integration-token-7f3a"
ROTATED = "sluice-admin-integration-token-rotated"
ADMIN_PATHS = ("/metrics", "/metrics/replicas", "/sluice/v1/replicas")


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def get(url: str, token: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    """GET ``url``: status, body, headers (lower-case names); errors are answers, not raises."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read(), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, err.read(), {k.lower(): v for k, v in err.headers.items()}


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.2)


@dataclass
class Served:
    public: str
    admin: str
    admin_port: int
    config_path: Path
    config: dict[str, Any]
    gateway: Proc

    def write_config(self, config: dict[str, Any]) -> None:
        """Replace the file atomically (as an editor or a ConfigMap update does)."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config_path)
        self.config = config


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("admin")
    public_port, admin_port, emulator_port = free_port(), free_port(), free_port()
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": public_port},
        "admin": {"host": "127.0.0.1", "port": admin_port, "token_sha256": sha256_hex(TOKEN)},
        "emulators": [{"name": "emu-0", "port": emulator_port, "seed": 1}],
        "health": {"interval_s": 0.5, "timeout_s": 0.5},
        "reload": {"watch": True, "poll_interval_s": 0.2},
    }
    config_path = tmp / "sluice.yaml"
    config_path.write_text(yaml.safe_dump(config))
    gateway = Proc([*_sluice(), "serve", "--config", str(config_path)], name="gateway-admin")
    try:
        public = f"http://127.0.0.1:{public_port}"
        gateway.wait_http(public + "/readyz")
        yield Served(public, f"http://127.0.0.1:{admin_port}", admin_port, config_path, config, gateway)
    finally:
        gateway.stop()
    # The admin listener goes with the process.
    assert not port_is_open(admin_port)


def test_public_listener_hides_admin_routes_and_keeps_probes(served: Served) -> None:
    hidden = [get(served.public + path, TOKEN) for path in ADMIN_PATHS]
    probes = [get(served.public + path)[0] for path in ("/healthz", "/readyz", "/v1/models")]

    assert [status for status, _, _ in hidden] == [404, 404, 404]
    for _, body, _ in hidden:
        assert json.loads(body)["error"]["code"] == "not_found"
    assert probes == [200, 200, 200]


@pytest.mark.parametrize("token", [None, "sk-not-the-admin-token"], ids=["no-token", "wrong-token"])
def test_admin_listener_refuses_without_the_token(served: Served, token: str | None) -> None:
    for path in ADMIN_PATHS:
        status, body, headers = get(served.admin + path, token)

        assert status == 401
        error = json.loads(body)["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "invalid_admin_token",
            None,
        )
        assert headers["www-authenticate"] == 'Bearer realm="sluice-admin"'
        assert TOKEN.encode() not in body
        if token is not None:
            assert token.encode() not in body


def test_admin_listener_serves_admin_routes_with_the_token(served: Served) -> None:
    metrics = get(served.admin + "/metrics", TOKEN)
    targets = get(served.admin + "/metrics/replicas", TOKEN)
    replicas = get(served.admin + "/sluice/v1/replicas", TOKEN)
    elsewhere = [get(served.admin + path)[0] for path in ("/healthz", "/v1/models")]

    assert (metrics[0], targets[0], replicas[0]) == (200, 200, 200)
    assert b"sluice_build_info" in metrics[1]
    assert [t["labels"]["replica"] for t in json.loads(targets[1])] == ["emu-0"]
    assert "emu-0" in replicas[1].decode()
    assert elsewhere == [404, 404]
    log = served.gateway.output()
    assert f"admin listener on {served.admin}" in log
    assert TOKEN not in log
    assert sha256_hex(TOKEN) not in log


def test_prometheus_scrapes_the_admin_listener_with_a_credentials_file(
    served: Served, tmp_path: Path
) -> None:
    """The scrape config deploy/prometheus/prometheus.yml documents for a token, for real."""
    secret = tmp_path / "sluice-admin"
    secret.write_text(TOKEN + "\n")
    # `type: Bearer` spelt out: Prometheus' http_sd_configs does not default it (it sends the bare
    # token; prometheus/prometheus#12762), while scrape configs do.
    auth = {"authorization": {"type": "Bearer", "credentials_file": str(secret)}}
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "sluice",
                "static_configs": [{"targets": [f"127.0.0.1:{served.admin_port}"]}],
                **auth,
            },
            {
                "job_name": "replicas",
                "http_sd_configs": [
                    {"url": served.admin + "/metrics/replicas", "refresh_interval": "1s", **auth}
                ],
            },
        ],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    prometheus = Proc(
        [
            tool("prometheus"),
            f"--config.file={config_path}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            "--log.level=warn",
        ],
        name="prometheus-admin",
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> dict[str, float]:
        query = urllib.parse.urlencode({"query": "up"})
        status, body, _ = get(f"{base}/api/v1/query?{query}")
        if status != 200:
            return {}
        return {r["metric"]["job"]: float(r["value"][1]) for r in json.loads(body)["data"]["result"]}

    try:
        prometheus.wait_http(base + "/-/ready", timeout_s=60)
        try:
            wait_until(lambda: up() == {"sluice": 1.0, "replicas": 1.0}, 60, "both jobs up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; up: {up()}; prometheus: {prometheus.output()[-2000:]}") from None
    finally:
        prometheus.stop()


def test_token_rotates_on_reload_and_the_address_needs_a_restart(served: Served) -> None:
    original = served.config
    moved = {**original["admin"], "port": free_port(), "token_sha256": sha256_hex(ROTATED)}
    served.write_config({**original, "admin": moved})
    try:
        wait_until(lambda: get(served.admin + "/metrics", ROTATED)[0] == 200, 20, "the rotated token works")

        assert get(served.admin + "/metrics", TOKEN)[0] == 401
        assert not port_is_open(moved["port"])
        assert "requires restart" in served.gateway.output()
    finally:
        served.write_config(original)
        wait_until(lambda: get(served.admin + "/metrics", TOKEN)[0] == 200, 20, "the first token is back")


def test_taken_admin_port_stops_serve_with_a_clear_message(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = int(holder.getsockname()[1])
        config = {
            "server": {"host": "127.0.0.1", "port": free_port()},
            "admin": {"port": taken},
            "replicas": [{"name": "r0", "url": f"http://127.0.0.1:{free_port()}"}],
            "health": {"interval_s": 0.5, "timeout_s": 0.2},
        }
        config_path = tmp_path / "sluice.yaml"
        config_path.write_text(yaml.safe_dump(config))
        proc = Proc([*_sluice(), "serve", "--config", str(config_path)], name="gateway-taken")
        try:
            proc.popen.wait(60)
        finally:
            proc.stop()

    assert proc.popen.returncode == 1, proc.output()
    assert f"admin listener on 127.0.0.1:{taken}" in proc.output()
