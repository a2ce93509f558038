"""docs/configuration.md is what ``gateway.config.reference`` renders from the settings models, and
that rendering lists every key with its type, default and description."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from gateway.config import reference
from gateway.config.reload import RESTART_ONLY
from gateway.config.settings import Settings

REPO = Path(__file__).resolve().parents[3]
DOCUMENT = REPO / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def text() -> str:
    return reference.render()


def _row(text: str, path: str) -> list[str]:
    """The cells of the table row whose key is ``path`` (the first, for a key two forms share)."""
    match = re.search(rf"^\| `{re.escape(path)}` \| (.*) \|$", text, re.MULTILINE)
    assert match is not None, f"no row for {path}"
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", match.group(1))]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Every model class anywhere in ``annotation`` (lists, maps, unions, ``Annotated``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _plain_field_count(model: type[BaseModel]) -> int:
    """Fields holding a value rather than sections, over every section reachable from ``model``
    (a section mounted twice, like ``hardware``, counts twice)."""
    count = 0
    for field in model.model_fields.values():
        children = _models_in(field.annotation)
        count += sum(_plain_field_count(child) for child in children) if children else 1
    return count


def test_committed_reference_is_up_to_date(text: str) -> None:
    assert DOCUMENT.read_text(encoding="utf-8") == text, (
        f"docs/configuration.md is out of date with the settings models: run `{reference.REGENERATE}`"
    )


def test_every_key_has_one_row_with_a_description(text: str) -> None:
    paths = reference.key_paths()
    # Counted independently of the module's walker: every field of every reachable section.
    assert len(paths) == _plain_field_count(Settings)
    assert len(paths) > 100
    for path in paths:
        assert _row(text, path)[2], f"{path}: empty description"
    # limits.token_weights.mode is the one key two forms share.
    assert len(set(paths)) == len(paths) - 1
    for expected in (
        "server.port",
        "replicas[].name",
        "replicas[].hardware.gpu",
        "emulators[].port",
        "admission.classes.<name>.ttft_target_s",
        "admission.classes.<name>.size_fairness.min_share",
        "tenants.tenants.<name>.limits.tokens_per_minute",
        "limits.redis.url",
        "limits.token_weights.reference_batch_seqs",
        "prediction.correction.half_life_s",
    ):
        assert expected in paths


def test_sections_follow_the_order_of_settings(text: str) -> None:
    headings = re.findall(r"^## `([a-z_]+)(?:\[\])?`$", text, re.MULTILINE)
    assert headings == list(Settings.model_fields)


@pytest.mark.parametrize(
    ("path", "type_", "default"),
    [
        ("server.port", "integer from 0 to 65535", "`8080`"),
        ("server.max_body_bytes", "integer > 0", "`8388608`"),
        ("logging.level", "one of `DEBUG`, `INFO`, `WARNING`, `ERROR`", "`INFO`"),
        ("admission.queue.reserve_after_s", "number > 0, or `null`", "`5.0`"),
        ("admission.yield_margin", "number >= 0 and < 1", "`0.2`"),
        ("limits.probe_interval_s", "number from 0.01 to 5", "`0.25`"),
        ("replicas[].url", r"string matching `^https?://[^/\s]+(/[^\s]*)?$`", "required"),
        ("replicas[].tokenizer", "non-empty string, or `null`", "`null`"),
        ("tenants.tenants.<name>.api_keys", "list of strings", "`[]`"),
        ("limits.token_weights.prompt", "number > 0", "required"),
    ],
)
def test_a_row_gives_type_bounds_and_default(text: str, path: str, type_: str, default: str) -> None:
    assert _row(text, path)[:2] == [type_, default]


def test_restart_only_keys_say_so(text: str) -> None:
    # Described as such in the model, and added from RESTART_ONLY where the description is silent.
    assert _row(text, "server.port")[2].endswith("Restart required.")
    assert "limits.on_storage_error" in RESTART_ONLY
    assert _row(text, "limits.on_storage_error")[2].endswith("Restart required.")
    assert _row(text, "scrape.window_s")[2].endswith("Restart required.")
    assert not _row(text, "health.interval_s")[2].endswith("Restart required.")


def test_factory_default_of_the_classes_is_shown_as_yaml(text: str) -> None:
    block = text.split("### `admission.classes.<name>`", 1)[1].split("| Key |", 1)[0]
    assert "```yaml\nadmission:\n  classes:\n    interactive:\n      stall_budget_horizon: 0.02\n" in block
    assert "    batch:\n      ttft_target_s: 60.0\n" in block


def test_markdown_stays_in_its_cells(text: str) -> None:
    # A pipe in a description or pattern is escaped; "<hex>" is not taken for an HTML tag.
    assert _row(text, "limits.redis.key_prefix")[2].startswith(
        "Prefix of every key: &lt;prefix>:{&lt;tenant>}:tokens\\|requests\\|leases."
    )
    for line in text.splitlines():
        if line.startswith("| `"):
            assert len(re.split(r"(?<!\\)\|", line)) == 6, line


def test_main_prints_the_reference(capsys: pytest.CaptureFixture[str], text: str) -> None:
    assert reference.main() == 0
    assert capsys.readouterr().out == text
