"""The Prometheus config, recording and alert rules are valid, and every alert is unit-tested and
documented. ``promtool`` does the checking; this file makes it part of ``make test``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.observability.prometheus import CONFIG, RULE_TESTS, RULES, promtool
from tests.support.procs import ROOT


def _alerts() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules += [rule for rule in group["rules"] if "alert" in rule]
    return rules


def test_promtool_check_config() -> None:
    done = promtool("check", "config", CONFIG)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(RULES)} rule files found" in done.stdout


def test_promtool_check_rules() -> None:
    done = promtool("check", "rules", *RULES)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_test_rules() -> None:
    assert RULE_TESTS, "no rule tests in deploy/prometheus/tests"
    done = promtool("test", "rules", *RULE_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_firing_unit_test() -> None:
    fired: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert len(names) >= 10
    assert names - fired == set(), "alerts with no test where they fire"


def test_every_alert_has_a_runbook_section_in_docs() -> None:
    doc = (ROOT / "docs" / "alerts.md").read_text()
    headings = {line[4:].strip().lower() for line in doc.splitlines() if line.startswith("### ")}
    for rule in _alerts():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert rule["alert"].lower() == anchor, rule["alert"]
        assert anchor in headings, f"docs/alerts.md lacks a '### {rule['alert']}' section"
        assert rule["labels"]["severity"] in {"warning", "critical"}


def test_rule_files_are_the_ones_the_config_loads() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    patterns = config["rule_files"]
    loaded = sorted({p for pattern in patterns for p in CONFIG.parent.glob(pattern)})
    assert loaded == [Path(p) for p in RULES]
