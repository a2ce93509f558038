"""Admission policies: one ``Admitter`` Protocol, one class per policy, picked by name in YAML.

``admission.policy`` names one of ``ADMITTERS``; ``make_admitter`` builds it from the validated
section (hot reload builds a new one from the new section). Every policy returns the same typed
``Decision`` values (``Admit``/``Queue``/``Reject``), so the controller, its queue, the engine and
both adapters (live gateway, virtual-time replay) treat them alike:

* ``slo`` (``SloAdmitter``): admits what its forecasts say will meet the class targets;
* ``admit_all``: the SLO admitter with every rule in shadow (routes by slack, admits all);
* ``concurrency_cap`` (``ConcurrencyCapAdmitter``): at most ``max_in_flight`` per replica, FIFO
  queue with a TTL;
* ``saturation`` (``SaturationAdmitter``): refuses when every replica is saturated (GAIE);
* ``none`` (``PassThroughAdmitter``): everything to the least busy replica.

Tenant requests/tokens per minute are not an admitter: the ``tenants:`` budgets
(``gateway.tenants.live`` over ``gateway.limits``) enforce them before admission, under any policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import Admitter
from gateway.admission.policies.concurrency_cap import ConcurrencyCapAdmitter
from gateway.admission.policies.none import PassThroughAdmitter
from gateway.admission.policies.saturation import SaturationAdmitter, saturated
from gateway.admission.policies.slo import SloAdmitter, admit_all
from gateway.admission.retry_after import RetryAfterPolicy

__all__ = [
    "ADMITTERS",
    "Admitter",
    "AdmitterFactory",
    "ConcurrencyCapAdmitter",
    "PassThroughAdmitter",
    "SaturationAdmitter",
    "SloAdmitter",
    "admit_all",
    "make_admitter",
    "saturated",
]

#: Builds a policy from the ``admission`` section and the Retry-After source it refuses with.
AdmitterFactory = Callable[[AdmissionSettings, RetryAfterPolicy], Admitter]

#: Admitters by their ``admission.policy`` name.
ADMITTERS: Final[dict[str, AdmitterFactory]] = {
    "slo": SloAdmitter,
    "admit_all": admit_all,
    "concurrency_cap": ConcurrencyCapAdmitter,
    "saturation": SaturationAdmitter,
    "none": PassThroughAdmitter,
}


def make_admitter(settings: AdmissionSettings, retry: RetryAfterPolicy) -> Admitter:
    """The admitter ``settings.policy`` names."""
    return ADMITTERS[settings.policy](settings, retry)
