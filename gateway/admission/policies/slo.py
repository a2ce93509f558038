"""``policy: slo`` (``SloAdmitter``, rules in ``gateway.admission.slo_admitter``) and ``admit_all``."""

from __future__ import annotations

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import Admitter
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.slo_admitter import SloAdmitter

__all__ = ["SloAdmitter", "admit_all"]


def admit_all(settings: AdmissionSettings, retry: RetryAfterPolicy) -> Admitter:
    """``policy: admit_all``: the SLO admitter with every rule in shadow (routes by slack, admits all)."""
    return SloAdmitter(settings, retry, shadow_all=True)
