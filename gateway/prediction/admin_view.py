"""The prediction service's admin view: its per-replica state as JSON-ready dicts.

``describe`` renders each ``ReplicaRecord`` (facts, fit report, freshness, the load it last
measured, dispatch overhead, per-API TTFT residuals, the correction, the steady state) for the
admin endpoint. Reads only; times are the caller's monotonic seconds, ``None`` in the output means
not known yet (no snapshot, no observation), non-finite numbers come out as ``None``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from gateway.prediction.finish_learning import api_residual_s
from gateway.prediction.record import ReplicaRecord
from gateway.prediction.service_config import PredictionConfig
from predictor import FEATURE_NAMES, FitReport, StepParams
from predictor.correction import CorrectionLearner

__all__ = ["describe"]


def describe(
    replicas: Mapping[str, ReplicaRecord],
    corrections: CorrectionLearner,
    config: PredictionConfig,
    output_quantile: float,
    now: float | None = None,
) -> dict[str, object]:
    """JSON-ready state for an admin endpoint (``PredictionService.describe``): per replica its
    facts, fit, freshness and forecast correction as of ``now`` (the caller's seconds; ``None``:
    its latest snapshot), and the output quantile forecasts assume."""
    described: dict[str, object] = {}
    for name, r in replicas.items():
        s = r.snapshot
        at = now if now is not None else (s.taken_at if s is not None else 0.0)
        obs = r.last_observation
        described[name] = {
            "facts": dataclasses.asdict(r.facts),
            "fit": _describe_report(r.report),
            "snapshots": r.snapshots,
            "stale_snapshots": r.stale_snapshots,
            "last_snapshot_at": None if s is None else s.taken_at,
            "metrics_at": None if s is None else s.metrics_at,
            "stale": None if s is None else s.stale,
            "stale_reason": None if s is None else s.stale_reason,
            "last_observation": None
            if obs is None
            else {
                "valid": obs.valid,
                "reason": None if obs.reason is None else str(obs.reason),
                "source": str(obs.source),
                "step_s": _finite(obs.step_s),
            },
            "background_prefill_tokens_per_step": r.load.prefill_tokens_per_step,
            "prefill_share": r.load.prefill_share,
            "finish_rate_per_s": r.load.finish_rate_per_s,
            "capacity_per_s": r.load.full_finish_rate_per_s,
            "dispatch_overhead_s": r.overhead_s,
            "api_ttft_residuals_s": {a: api_residual_s(r, a, config) for a in sorted(r.api_requests)},
            "correction": corrections.describe(name, at),
            "steady_state": None
            if r.steady is None
            else {
                "step_s": r.steady.step_s,
                "decode_seqs": r.steady.decode_seqs,
                "prefill_share": r.steady.prefill_share,
            },
        }
    return {"output_quantile": output_quantile, "replicas": described}


def _finite(x: float | None) -> float | None:
    """``x`` if a finite number, else ``None`` (JSON has no NaN or infinity)."""
    return x if x is not None and math.isfinite(x) else None


def _params(p: StepParams) -> dict[str, float]:
    values = dict(zip(FEATURE_NAMES, p.coefficients(), strict=True))
    return {**values, "knee_tokens": p.knee_tokens, "attn_pair_tokens": p.attn_pair_tokens}


def _describe_report(rep: FitReport) -> dict[str, object]:
    return {
        "source": str(rep.source),
        "valid": rep.valid,
        "reason": rep.reason,
        "params": _params(rep.params),
        "prior": None if rep.prior is None else _params(rep.prior),
        "mdape": rep.mdape,
        "prior_mdape": rep.prior_mdape,
        "observations_total": rep.observations_total,
        "observations_kept": rep.observations_kept,
        "effective_observations": rep.effective_observations,
        "prior_weight": rep.prior_weight,
        "rejected": {str(k): v for k, v in rep.rejected},
    }
