"""``sluice plan --from-gateway``: a replica profile from the step model a running gateway fitted.

A real HTTP server (``http.server`` on a loopback port, in a thread) serves a canned
``GET /sluice/v1/replicas`` body built from the gateway's own records (``ReplicaFacts``, the
admin view's coefficient names), so the urllib fetch, the token header and the error paths run
for real. The plan run is a few virtual seconds.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.prediction import ReplicaFacts
from planner.cli import main
from planner.gateway_profile import fetch_replicas, profile_from_gateway
from predictor import FEATURE_NAMES, StepBatch, StepModel, StepParams
from simulator.costmodel import StepModelCost, StepShape, cost_model_for
from simulator.engine import Engine
from simulator.profile import load_profile

PARAMS = StepParams(
    base_s=6e-3,
    per_token_s=2e-6,
    per_decode_seq_s=1e-5,
    per_compute_token_s=2.5e-5,
    per_kv_token_s=2e-8,
    per_attn_pair_s=1e-10,
    knee_tokens=300.0,
    attn_pair_tokens=0.01,
)
TOKEN = "s3cret-admin"
SMALL = ["--rate", "4", "--prompt-tokens", "256", "--output-tokens", "uniform:16:48", "--duration-s", "4"]


def _fit(params: StepParams = PARAMS, *, valid: bool = True, reason: str | None = None) -> dict[str, Any]:
    """A fit as the admin view renders it (``gateway.prediction.admin_view``)."""
    values = dict(zip(FEATURE_NAMES, params.coefficients(), strict=True))
    return {
        "source": "fitted" if valid else "none",
        "valid": valid,
        "reason": reason,
        "params": {**values, "knee_tokens": params.knee_tokens, "attn_pair_tokens": params.attn_pair_tokens},
        "prior": None,
        "mdape": 0.032,
        "prior_mdape": 0.11,
        "observations_total": 900,
        "observations_kept": 512,
        "effective_observations": 480.0,
        "prior_weight": 0.1,
        "rejected": {},
    }


def _view(**fits: dict[str, Any]) -> dict[str, Any]:
    """A ``GET /sluice/v1/replicas`` body with one replica per fit."""
    facts = ReplicaFacts(
        gpu="H100-SXM", model="meta-llama/Llama-3.1-8B-Instruct", max_num_seqs=128, max_model_len=4096
    )
    metrics = {"stale": False, "num_running": 3, "kv_capacity_tokens": 200_000, "block_size": 16}
    return {
        "replicas": [{"name": name, "state": "healthy", "metrics": metrics} for name in fits],
        "prediction": {
            "output_quantile": 0.9,
            "replicas": {
                name: {"facts": dataclasses.asdict(facts), "fit": fit} for name, fit in fits.items()
            },
        },
    }


class _Gateway:
    """The canned admin endpoint: ``body`` at ``/sluice/v1/replicas`` (behind ``token`` when set);
    ``headers`` records each request's ``Authorization``."""

    def __init__(self) -> None:
        self.body: dict[str, Any] = _view(a=_fit())
        self.token: str | None = None
        self.headers: list[str | None] = []
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                gateway.headers.append(self.headers.get("Authorization"))
                if self.path != "/sluice/v1/replicas":
                    self.send_error(404)
                    return
                if gateway.token and self.headers.get("Authorization") != f"Bearer {gateway.token}":
                    self.send_error(401)
                    return
                raw = json.dumps(gateway.body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, format: str, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def gateway() -> Iterator[_Gateway]:
    g = _Gateway()
    thread = threading.Thread(target=g.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield g
    finally:
        g.server.shutdown()
        g.server.server_close()
        thread.join(5)


def _batch(shape: StepShape) -> StepBatch:
    return StepBatch(
        prefill_tokens=shape.num_prefill_tokens,
        decode_seqs=shape.num_decode_seqs,
        kv_tokens_read=sum(shape.decode_contexts),
        prefill_attn_pairs=sum(c * (c / 2 + ctx) for c, ctx in shape.prefill_chunks),
    )


@pytest.mark.parametrize(
    "shape",
    [
        StepShape(decode_contexts=(1000,) * 64),  # decodes only, below the knee
        StepShape(prefill_chunks=((2048, 0),)),  # one chunk past the knee
        StepShape(prefill_chunks=((512, 1024),), decode_contexts=(300, 2000, 50)),  # mixed
    ],
    ids=["decode-64", "prefill-2048", "mixed"],
)
def test_the_profile_prices_a_step_as_the_fitted_step_model(gateway: _Gateway, shape: StepShape) -> None:
    built = profile_from_gateway(fetch_replicas(gateway.url), gateway.url, load_profile("llama3-8b-h100"))
    cost = cost_model_for(built.profile)
    assert isinstance(cost, StepModelCost)
    expected = StepModel(PARAMS).step_time(_batch(shape))
    assert cost.step_time_s(shape) == pytest.approx(expected, rel=1e-12)
    assert built.step_model.step_time(_batch(shape)) == pytest.approx(expected, rel=1e-12)
    # The engine runs it: a step's duration is the step model's (no jitter).
    assert Engine(built.profile).cost_model.step_time_s(shape) == pytest.approx(expected, rel=1e-12)


def test_facts_limits_and_source_come_from_the_gateway(gateway: _Gateway) -> None:
    built = profile_from_gateway(fetch_replicas(gateway.url), gateway.url, load_profile("llama3-8b-a100"))
    p = built.profile
    assert (p.gpu.name, p.served_model_name, p.tensor_parallel) == (
        "H100-SXM",
        "meta-llama/Llama-3.1-8B-Instruct",
        1,
    )
    assert (p.engine.max_num_seqs, p.engine.max_num_batched_tokens, p.engine.max_model_len) == (
        128,
        8192,
        4096,
    )
    # 200,000 tokens in blocks of 16.
    assert (p.engine.block_size, p.kv_cache_size_tokens) == (16, 200_000)
    assert built.source == (
        f"step model fitted by gateway {gateway.url} for replica a "
        "(fitted, fit error (MdAPE) 3.2% over 512 observations)"
    )
    assert built.assumed == ()


def test_what_the_gateway_does_not_say_is_assumed_and_listed(gateway: _Gateway) -> None:
    body = _view(a=_fit())
    body["replicas"] = []  # never scraped: no KV capacity, no block size
    facts = body["prediction"]["replicas"]["a"]["facts"]
    facts.update(gpu=None, model="some-private-model", max_model_len=None)
    template = load_profile("llama3-8b-h100")
    built = profile_from_gateway(body, gateway.url, template, block_size=32)
    p = built.profile
    assert (p.gpu, p.model, p.engine.block_size) == (template.gpu, template.model, 32)
    assert p.engine.max_model_len == template.engine.max_model_len
    assert len(built.assumed) == 4
    assert built.assumed[0].startswith("GPU H100-SXM5-80GB (from profile llama3-8b-h100")
    assert built.assumed[-1].startswith(
        f"KV capacity {p.kv_cache_size_tokens:,} tokens (sized from GPU memory"
    )
    # The flag wins over the scrape.
    scraped = profile_from_gateway(_view(a=_fit()), gateway.url, template, kv_capacity_tokens=64_000)
    assert scraped.profile.kv_cache_size_tokens == 64_000


def test_a_plan_runs_from_the_gateway_and_sends_the_token(
    gateway: _Gateway, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway.token = TOKEN
    monkeypatch.setenv("PLAN_ADMIN_TOKEN", TOKEN)
    out = tmp_path / "plan.json"
    argv = [*SMALL, "--from-gateway", gateway.url, "--admin-token-env", "PLAN_ADMIN_TOKEN"]
    assert main([*argv, "--curve-loads", "", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert gateway.headers == [f"Bearer {TOKEN}"]
    assert "sluice plan: profile gateway-a" in printed
    assert f"step model fitted by gateway {gateway.url} for replica a" in printed
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["replicas"] >= 1
    assert data["profile_notes"][0].startswith("step model fitted by gateway")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unreachable", "cannot reach gateway"),
        ("no-token", "answered 401: the admin API needs a token"),
        ("unknown-replica", "no replica 'nosuch' (it has: a, b)"),
        ("several", "has several replicas (a, b): pick one with --replica"),
        ("invalid-fit", "replica 'b': no valid step model (too few observations)"),
        ("token-env-unset", "PLAN_NO_SUCH_VAR: that environment variable is not set"),
        ("flag-without-gateway", "--replica: only with --from-gateway URL"),
    ],
)
def test_errors_exit_2_with_a_clear_message(
    gateway: _Gateway, case: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway.body = _view(a=_fit(), b=_fit(valid=False, reason="too few observations"))
    url = gateway.url
    extra: list[str] = []
    if case == "unreachable":
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
    elif case == "no-token":
        gateway.token = TOKEN
    elif case == "unknown-replica":
        extra = ["--replica", "nosuch"]
    elif case == "invalid-fit":
        extra = ["--replica", "b"]
    elif case == "token-env-unset":
        extra = ["--admin-token-env", "PLAN_NO_SUCH_VAR"]
    where = ["--replica", "a"] if case == "flag-without-gateway" else ["--from-gateway", url]
    argv = [*SMALL, "--curve-loads", "", *extra, *where]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice plan: ")
    assert message in err
