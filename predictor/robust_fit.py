"""The step-model fit's solver: robust, relative-error, penalised non-negative least squares.

``robust_fit`` solves ``x @ coef ~ y`` for the six step-model coefficients (seconds per unit,
never negative) in relative error, with a ridge toward a target and a tie between the attention
and compute terms (``Penalty``), reweighted by Huber (IRLS) against outliers. ``balanced``,
``units`` and ``mdape`` are the weighting, scaling and error helpers ``predictor.calibrate`` uses
around it. Pure numpy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from predictor.step_model import FEATURE_NAMES, StepParams

__all__ = ["ATTN", "COMPUTE", "N_FEATURES", "Penalty", "Vec", "balanced", "mdape", "robust_fit", "units"]

Vec = npt.NDArray[np.float64]
#: Features (coefficients) of a row, and the indices of the compute-past-knee and attention terms.
N_FEATURES: Final = len(FEATURE_NAMES)
COMPUTE: Final = FEATURE_NAMES.index("tokens_past_knee")
ATTN: Final = FEATURE_NAMES.index("attn_pairs")
# Feature magnitudes that make a coefficient "matter" when the data says nothing about its scale:
# the prior penalty is measured at least at these values relative to a typical step (see units).
_REFERENCE: Final = np.array([1.0, 256.0, 64.0, 1024.0, 65536.0, 2048.0 * 2048.0 / 2.0])


def balanced(weights: Vec, kinds: npt.NDArray[np.int_]) -> Vec:
    """``weights`` rescaled so that every kind present in ``kinds`` totals the same, their sum
    unchanged (each kind's rows keep their relative weights)."""
    present = np.unique(kinds)
    if len(present) < 2:
        return weights
    share = float(weights.sum()) / len(present)
    out = weights.copy()
    for kind in present:
        mask = kinds == kind
        total = float(weights[mask].sum())
        if total > 0.0:
            out[mask] *= share / total
    return out


def mdape(params: StepParams, x: Vec, y: Vec) -> float:
    """Median absolute percentage error (a fraction) of ``params`` on rows ``x`` -> ``y``."""
    predicted = x @ np.array(params.coefficients())
    return float(np.median(np.abs(predicted - y) / y))


def units(x: Vec, y: Vec, weights: Vec) -> Vec:
    """Per coefficient: how much relative step time one unit of it explains, typically.

    The weighted RMS over observations of ``x_ij / y_i``, never below the reference magnitude over
    the median step. Scaling coefficients by it puts the data and the prior in one currency: a
    penalty of ``s x d^2`` costs as much as ``s`` observations each off by a fraction ``d``.
    """
    rms = np.sqrt((weights[:, None] * (x / y[:, None]) ** 2).sum(axis=0) / max(float(weights.sum()), 1e-12))
    result: Vec = np.maximum(rms, _REFERENCE / float(np.median(y)))
    return result


@dataclass(frozen=True, slots=True)
class Penalty:
    """Ridge ``sum_j ridge_j (phi_j - target_j)^2`` plus ``tie x (c_a - alpha c_c)^2``, in scaled units."""

    ridge: Vec
    target: Vec
    tie: float
    alpha: float


def robust_fit(
    x: Vec,
    y: Vec,
    weights: Vec,
    penalty: Penalty,
    unit: Vec,
    *,
    robust: bool,
    iterations: int,
    huber_k: float,
) -> Vec:
    """Non-negative Huber-IRLS penalised fit of ``x @ coef ~ y`` in relative error; returns ``coef``.

    Works in scaled coordinates ``phi = coef x unit`` (dimensionless: the typical share of a step's
    time each term explains), where the prior penalty is ``ridge x (phi - phi0)^2``.
    """
    z = x / unit / y[:, None]  # row i: feature contributions relative to observed step time
    # Tie, in phi: (phi_a / unit_a - alpha phi_c / unit_c) x unit_a.
    tie = np.zeros(N_FEATURES)
    tie[ATTN], tie[COMPUTE] = 1.0, -penalty.alpha * unit[ATTN] / unit[COMPUTE]
    p_matrix = np.diag(penalty.ridge) + penalty.tie * np.outer(tie, tie)
    p_vector = penalty.ridge * penalty.target * unit
    phi = _nnls_penalised(z, weights, p_matrix, p_vector)
    for _ in range(iterations if robust else 0):
        r = z @ phi - 1.0
        # Residual scale from the weighted MAD: forgotten observations must not set it.
        scale = max(1.4826 * _weighted_median(np.abs(r - _weighted_median(r, weights)), weights), 0.02)
        huber = np.minimum(1.0, huber_k * scale / np.maximum(np.abs(r), 1e-12))
        new = _nnls_penalised(z, weights * huber, p_matrix, p_vector)
        converged = np.allclose(new, phi, rtol=1e-6, atol=1e-9)
        phi = new
        if converged:
            break
    result: Vec = phi / unit
    return result


def _weighted_median(values: Vec, weights: Vec) -> float:
    """The value at half the total weight (weights >= 0, not all zero)."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


def _nnls_penalised(z: Vec, w: Vec, p_matrix: Vec, p_vector: Vec) -> Vec:
    """argmin_{phi >= 0} sum_i w_i (z_i . phi - 1)^2 + phi' P phi - 2 p' phi (P positive definite)."""
    a = (z.T * w) @ z + p_matrix
    b = (z.T * w).sum(axis=1) + p_vector
    phi: Vec = np.linalg.solve(a, b)
    if (phi >= 0.0).all():
        return phi
    found = _active_set(a, b)
    return found if found is not None else _enumerate(a, b)


def _active_set(a: Vec, b: Vec) -> Vec | None:
    """Minimise ``phi' a phi - 2 b' phi`` over ``phi >= 0`` by a primal active set (a is SPD).

    Clamp negative coordinates to zero and re-solve on the rest; then free any clamped coordinate
    whose gradient still points inward. ``None`` if it has not converged in a few rounds.
    """
    free = np.ones(N_FEATURES, dtype=bool)
    for _ in range(4 * N_FEATURES):
        phi = np.zeros(N_FEATURES)
        if free.any():
            phi[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if (phi < 0.0).any():
            free &= phi > 0.0
            continue
        gradient = a @ phi - b
        inward = ~free & (gradient < -1e-12)
        if not inward.any():
            return phi
        free[int(np.argmin(np.where(inward, gradient, np.inf)))] = True
    return None


def _enumerate(a: Vec, b: Vec) -> Vec:
    """Exact fallback: the best non-negative solution over all 2^6 free sets."""
    best, best_obj = np.zeros(N_FEATURES), 0.0  # all-zero is always feasible, objective 0
    for size in range(1, N_FEATURES + 1):
        for free in itertools.combinations(range(N_FEATURES), size):
            idx = list(free)
            sub = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (sub < 0.0).any():
                continue
            cand = np.zeros(N_FEATURES)
            cand[idx] = sub
            obj = float(cand @ a @ cand - 2.0 * b @ cand)
            if obj < best_obj:
                best, best_obj = cand, obj
    return best
