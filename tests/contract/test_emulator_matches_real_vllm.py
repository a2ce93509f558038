"""The replica emulator against what a real vLLM 0.32.0 answered: same statuses, types and shapes.

``tests/e2e/data/vllm-0.32.0-shapes.json`` holds a real vLLM's answers (recorded by
``tests/e2e/test_vllm_contract.py``) to each exchange of ``tests.e2e.shapes.EXCHANGES``: status,
content type, the keys and JSON types of the body, the SSE chunk order and each chunk kind's shape,
and the ``vllm:`` metric families with their types and labels. Here the emulator runs as a real
process (``python -m simulator``, as ``sluice sim`` runs it) with the recorded ``max_model_len``,
the same exchanges are replayed against it (asking for its own served model name instead of
``tiny-llama``), and every entry is diffed against the recording.

A difference kept on purpose is listed in :data:`ALLOWED` with its reason; one that disappears
fails :func:`test_allow_list_has_no_stale_entries`, so the list never outlives its reason.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from simulator.profile import Profile, load_profile
from tests.contract.test_vllm_metrics_contract import EXCLUDED as METRICS_LEFT_OUT
from tests.e2e.shapes import (
    EXCHANGES,
    Exchange,
    Observation,
    describe,
    diff_entries,
    diff_shapes,
    load_shapes,
    metric_families,
    observe_http,
    with_model,
)
from tests.support.procs import Proc, free_port

pytestmark = pytest.mark.timeout(120)

RECORDED = load_shapes()
MAX_MODEL_LEN: int = RECORDED["server"]["max_model_len"]
BASE_PROFILE = "llama3-8b-h100"
#: Engine steps run this many times faster than on the profile's GPU, so the exchange that
#: generates ~1000 tokens takes about a second, not seven. Shapes do not depend on step times.
SPEEDUP = 8.0

#: ``(entry, diff line) -> reason`` for each difference from the real vLLM that is kept on purpose.
#: ``entry`` is an exchange name or ``"metrics"``; the lines are those of ``diff_entries`` and
#: ``diff_shapes``.
ALLOWED: dict[tuple[str, str], str] = {
    ("metrics", f"$.{name}: missing"): f"family not emulated: {reason}"
    for name, reason in METRICS_LEFT_OUT.items()
}


def fast_profile() -> Profile:
    """The shipped H100 profile at the recorded ``max_model_len``, steps :data:`SPEEDUP`-fold faster."""
    base = load_profile(BASE_PROFILE).with_engine(max_model_len=MAX_MODEL_LEN)
    data = base.model_dump()
    data["gpu"]["hbm_bandwidth_Bps"] *= SPEEDUP
    data["gpu"]["peak_bf16_flops"] *= SPEEDUP
    data["cost"]["per_step_overhead_s"] /= SPEEDUP
    data["cost"]["linear_scale"] /= SPEEDUP
    return Profile.model_validate(data)


@dataclass(frozen=True)
class Replay:
    """The emulator's answers: each exchange's recorded-style entry, raw observation, and a scrape."""

    model: str
    entries: dict[str, dict[str, Any]]
    observed: dict[str, Observation]
    metrics_text: str


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replay]:
    profile = fast_profile()
    path = tmp_path_factory.mktemp("emulator") / "profile.yaml"
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    port = free_port()
    proc = Proc(
        [
            *(sys.executable, "-m", "simulator"),
            *("--profile", str(path), "--port", str(port), "--seed", "1"),
        ],
        name="emulator-contract",
    )
    try:
        base_url = f"http://127.0.0.1:{port}"
        proc.wait_http(base_url + "/health", timeout_s=60.0)
        model = profile.served_model_name
        observed = {ex.name: observe_http(base_url, with_model(ex, model)) for ex in EXCHANGES}
        entries = {ex.name: describe(ex, observed[ex.name]) for ex in EXCHANGES}
        with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
            metrics_text = resp.read().decode()
        yield Replay(model, entries, observed, metrics_text)
    finally:
        proc.stop()


def differences(replay: Replay) -> dict[tuple[str, str], None]:
    """Every difference from the recording, in order, keyed like :data:`ALLOWED`."""
    found: dict[tuple[str, str], None] = {}
    for ex in EXCHANGES:
        for line in diff_entries(RECORDED["exchanges"][ex.name], replay.entries[ex.name]):
            found[(ex.name, line)] = None
    for line in diff_shapes(RECORDED["metrics"], metric_families(replay.metrics_text), null_matches=False):
        found[("metrics", line)] = None
    return found


def test_every_recorded_exchange_is_replayed() -> None:
    assert sorted(RECORDED["exchanges"]) == sorted(ex.name for ex in EXCHANGES)


@pytest.mark.parametrize("name", [ex.name for ex in EXCHANGES], ids=[ex.name for ex in EXCHANGES])
def test_exchange_matches_recording(replay: Replay, name: str) -> None:
    lines = diff_entries(RECORDED["exchanges"][name], replay.entries[name])
    unexplained = [line for line in lines if (name, line) not in ALLOWED]
    assert unexplained == [], replay.observed[name].body[:600]


def test_metric_families_match_recording(replay: Replay) -> None:
    lines = diff_shapes(RECORDED["metrics"], metric_families(replay.metrics_text), null_matches=False)
    assert [line for line in lines if ("metrics", line) not in ALLOWED] == []


def test_allow_list_has_no_stale_entries(replay: Replay) -> None:
    assert sorted(set(ALLOWED) - set(differences(replay))) == []


# The facts below are values, not shapes: those the e2e contract test checks on the real vLLM.


def exchange(name: str) -> Exchange:
    return next(ex for ex in EXCHANGES if ex.name == name)


def test_status_and_content_type_of_every_exchange_match(replay: Replay) -> None:
    # Also part of the shape diff; spelled out here so a failure names the status directly.
    seen = {name: (entry["status"], entry["content_type"]) for name, entry in replay.entries.items()}
    recorded = {
        name: (entry["status"], entry["content_type"]) for name, entry in RECORDED["exchanges"].items()
    }
    assert seen == recorded


@pytest.mark.parametrize(
    ("name", "error_type", "param"),
    [
        ("error_unknown_model", "NotFoundError", "model"),
        ("error_max_tokens_over_max_model_len", "BadRequestError", "max_tokens"),
        ("error_invalid_json", "Bad Request", "body.<end of body>"),
    ],
    ids=["unknown-model", "max-tokens-over-limit", "invalid-json"],
)
def test_error_body_values(replay: Replay, name: str, error_type: str, param: str) -> None:
    seen = replay.observed[name]
    error = seen.json()["error"]
    if param == "body.<end of body>":
        # The body is cut off after "[": JSON decoding fails at its end, wherever that is.
        param = f"body.{len(with_model(exchange(name), replay.model).body or b'')}"
    assert (error["type"], error["code"], error["param"]) == (error_type, seen.status, param)
    assert error["message"]


@pytest.mark.parametrize("name", ["chat", "completion", "chat_stream_usage", "completion_stream_usage"])
def test_ignore_eos_output_is_exactly_max_tokens(replay: Replay, name: str) -> None:
    seen = replay.observed[name]
    if exchange(name).streams:
        last_chunk = seen.body.split(b"\n\n")[-3].removeprefix(b"data: ")
        use = json.loads(last_chunk)["usage"]
    else:
        use = seen.json()["usage"]
        assert seen.json()["choices"][0]["finish_reason"] == "length"
    assert use["completion_tokens"] == 8
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]


def test_prompt_plus_max_tokens_over_limit_is_capped_not_rejected(replay: Replay) -> None:
    body = replay.observed["prompt_plus_max_tokens_over_max_model_len"].json()
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"


def test_request_params_max_tokens_records_the_capped_value(replay: Replay) -> None:
    # The real 0.32 server, asked the same with max_tokens=1020, recorded 998 (= 1024 - 26 prompt
    # tokens) in vllm:request_params_max_tokens, not 1020: the cap is applied before the engine.
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(replay.metrics_text)}
    samples = {s.name: s.value for s in families["vllm:request_params_max_tokens"].samples}
    capped = replay.observed["prompt_plus_max_tokens_over_max_model_len"].json()["usage"]["completion_tokens"]
    # Every other generating exchange asks for 8 tokens; the unknown-model one never reaches the engine.
    generating = [ex for ex in EXCHANGES if replay.entries[ex.name]["status"] == 200 and ex.body is not None]
    assert samples["vllm:request_params_max_tokens_sum"] == 8 * (len(generating) - 1) + capped
