"""The ``admission`` section: defaults, and every violation reported with its path and value."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.admission import AdmissionSettings, ClassSettings
from gateway.config.settings import SettingsViolations


def test_defaults_are_valid_and_documented() -> None:
    s = AdmissionSettings()
    assert set(s.classes) == {"interactive", "batch"}
    assert s.default_class == "interactive"
    assert s.classes["batch"].yields_to == ["interactive"]
    assert s.classes["batch"].priority > s.classes["interactive"].priority
    assert 0 < s.classes["batch"].kv_share < 1
    assert s.expose_prediction_headers
    assert s.retry_after.max_s <= 60
    for model in (
        AdmissionSettings,
        ClassSettings,
        type(s.retry_after),
        type(s.queue),
        type(s.shadow),
        type(s.headers),
    ):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_more_classes_can_be_configured() -> None:
    s = AdmissionSettings.model_validate(
        {
            "classes": {
                "premium": {"ttft_target_s": 0.5, "priority": 0},
                "standard": {"priority": 5, "yields_to": ["premium"]},
                "bulk": {"priority": 9, "yields_to": ["premium", "standard"], "kv_share": 0.3},
            },
            "default_class": "standard",
        }
    )
    assert s.tightest_tpot_target_s() == pytest.approx(0.1)
    assert s.class_settings("unknown") is s.classes["standard"]


def cross_field(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str, object]]:
    """The cross-field violations raised for ``data``: (path, message, value)."""
    with pytest.raises(ValidationError) as info:
        AdmissionSettings.model_validate(data)
    found = []
    for error in info.value.errors():
        cause = error.get("ctx", {}).get("error")
        assert isinstance(cause, SettingsViolations), error
        found += [(v.path, v.message, v.value) for v in cause.violations]
    return found


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            {"default_class": "gold"},
            [(("default_class",), "not a configured class (known: batch, interactive)", "gold")],
            id="default-class-missing",
        ),
        pytest.param(
            {"classes": {}}, [(("classes",), "at least one class is required", {})], id="no-classes"
        ),
        pytest.param(
            {"classes": {"interactive": {"yields_to": ["interactive"]}}},
            [(("classes", "interactive", "yields_to", 0), "a class cannot yield to itself", "interactive")],
            id="yields-to-itself",
        ),
        pytest.param(
            {"classes": {"interactive": {}, "batch": {"priority": 5, "yields_to": ["gold"]}}},
            [(("classes", "batch", "yields_to", 0), "not a configured class", "gold")],
            id="yields-to-unknown",
        ),
        pytest.param(
            {
                "classes": {
                    "interactive": {"priority": 5},
                    "batch": {"priority": 1, "yields_to": ["interactive"]},
                }
            },
            [
                (
                    ("classes", "batch", "yields_to", 0),
                    "must name a more important class (lower priority than 1), but its priority is 5",
                    "interactive",
                )
            ],
            id="yields-to-less-important",
        ),
        pytest.param(
            {"default_class": "gold", "classes": {"interactive": {"yields_to": ["x"]}}},
            [
                (("default_class",), "not a configured class (known: interactive)", "gold"),
                (("classes", "interactive", "yields_to", 0), "not a configured class", "x"),
            ],
            id="all-reported-at-once",
        ),
        pytest.param(
            {"retry_after": {"min_s": 5.0, "max_s": 2.0}},
            [(("min_s",), "must not exceed max_s (2.0)", 5.0)],
            id="retry-min-above-max",
        ),
    ],
)
def test_cross_field_violations(data: dict[str, Any], expected: list[tuple[Any, str, object]]) -> None:
    assert cross_field(data) == expected


@pytest.mark.parametrize(
    ("data", "loc", "kind"),
    [
        pytest.param(
            {"classes": {"interactive": {"ttft_target_s": 0}}},
            ("classes", "interactive", "ttft_target_s"),
            "greater_than",
            id="ttft-target-zero",
        ),
        pytest.param(
            {"classes": {"interactive": {"tpot_target_s": -0.1}}},
            ("classes", "interactive", "tpot_target_s"),
            "greater_than",
            id="tpot-target-negative",
        ),
        pytest.param(
            {"classes": {"interactive": {"kv_share": 0.0}}},
            ("classes", "interactive", "kv_share"),
            "greater_than",
            id="kv-share-zero",
        ),
        pytest.param(
            {"classes": {"interactive": {"slot_share": 1.5}}},
            ("classes", "interactive", "slot_share"),
            "less_than_equal",
            id="slot-share-over-one",
        ),
        pytest.param(
            {"classes": {"interactive": {"max_prompt_tokens": 0}}},
            ("classes", "interactive", "max_prompt_tokens"),
            "greater_than_equal",
            id="max-prompt-zero",
        ),
        pytest.param(
            {"classes": {"interactive": {"queue_capacity": -1}}},
            ("classes", "interactive", "queue_capacity"),
            "greater_than_equal",
            id="negative-queue",
        ),
        pytest.param(
            {"classes": {"interactive": {"priority": "high"}}},
            ("classes", "interactive", "priority"),
            "int_type",
            id="priority-not-int",
        ),
        pytest.param(
            {"classes": {"interactive": {"ttft_target": 1.0}}},
            ("classes", "interactive", "ttft_target"),
            "extra_forbidden",
            id="unknown-class-key",
        ),
        pytest.param(
            {"classes": {"bad name!": {}}},
            ("classes", "bad name!", "[key]"),
            "string_pattern_mismatch",
            id="bad-class-name",
        ),
        pytest.param(
            {"retry_after": {"max_s": 61.0}},
            ("retry_after", "max_s"),
            "less_than_equal",
            id="retry-cap-over-60",
        ),
        pytest.param(
            {"retry_after": {"jitter_fraction": 1.5}},
            ("retry_after", "jitter_fraction"),
            "less_than_equal",
            id="jitter-over-one",
        ),
        pytest.param({"yield_margin": 1.0}, ("yield_margin",), "less_than", id="yield-margin-one"),
        pytest.param(
            {"stale_margin": -0.1}, ("stale_margin",), "greater_than_equal", id="stale-margin-negative"
        ),
        pytest.param(
            {"queue": {"aging_rate": -1.0}},
            ("queue", "aging_rate"),
            "greater_than_equal",
            id="aging-negative",
        ),
        pytest.param(
            {"headers": {"request_class": "X-Sluice-Class"}},
            ("headers", "request_class"),
            "string_pattern_mismatch",
            id="header-not-lower-case",
        ),
        pytest.param({"policy": "fifo"}, ("policy",), "literal_error", id="unknown-policy"),
        pytest.param({"shadow": {"slo": "yes"}}, ("shadow", "slo"), "bool_type", id="shadow-not-bool"),
    ],
)
def test_field_violations(data: dict[str, Any], loc: tuple[str, ...], kind: str) -> None:
    with pytest.raises(ValidationError) as info:
        AdmissionSettings.model_validate(data)
    assert [(tuple(e["loc"]), e["type"]) for e in info.value.errors()] == [(loc, kind)]


def test_settings_are_frozen() -> None:
    s = AdmissionSettings()
    with pytest.raises(ValidationError):
        s.stale_margin = 2.0  # type: ignore[misc]
