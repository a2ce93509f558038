"""The prediction headers every response carries (``admission.expose_prediction_headers``).

Plain ``dict[str, str]`` so the HTTP layer can merge them into any response. A refusal's own
headers (Retry-After, the reason of a refusal no decision described) are ``gateway.http.errors``'s.
"""

from __future__ import annotations

import math
from typing import Final

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import Admit, Decision, Queue

__all__ = [
    "ADMISSION",
    "CLASS",
    "PREDICTED_TPOT_MS",
    "PREDICTED_TTFT_MS",
    "REASON",
    "decision_headers",
]

CLASS: Final = "x-sluice-class"
ADMISSION: Final = "x-sluice-admission"
REASON: Final = "x-sluice-admission-reason"
PREDICTED_TTFT_MS: Final = "x-sluice-predicted-ttft-ms"
PREDICTED_TPOT_MS: Final = "x-sluice-predicted-tpot-ms"


def decision_headers(decision: Decision, request_class: str, settings: AdmissionSettings) -> dict[str, str]:
    """Headers describing ``decision``: class, outcome, reason and the predictions (ms, 0.1 ms).

    ``x-sluice-admission``: ``admitted``, ``queued``, ``rejected``, or ``shadow`` (a rule would
    have queued or rejected it but runs in shadow mode, so it was admitted);
    ``x-sluice-admission-reason``: ``ok``, the ``Blocker`` or the ``RejectReason``. Predictions
    are omitted when unknown (no replica, no step model). Empty when the setting is off.
    """
    if not settings.expose_prediction_headers:
        return {}
    if isinstance(decision, Admit):
        outcome, reason = "admitted", "ok"
    elif isinstance(decision, Queue):
        outcome, reason = "queued", decision.blocker.value
    else:
        outcome, reason = "rejected", decision.reason.value
    if not decision.enforced:
        outcome = "shadow"
    headers = {CLASS: request_class, ADMISSION: outcome, REASON: reason}
    f = decision.forecast
    if f is not None and math.isfinite(f.ttft_s) and math.isfinite(f.tpot_s):
        headers[PREDICTED_TTFT_MS] = f"{f.ttft_s * 1e3:.1f}"
        headers[PREDICTED_TPOT_MS] = f"{f.tpot_s * 1e3:.2f}"
    return headers
