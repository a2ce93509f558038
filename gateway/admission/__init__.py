"""SLO-aware admission: the pure core (no I/O, no clock reads; times come in as ``now``).

``AdmissionController`` is the entry point: it forecasts a request on every healthy replica,
routes it to the one with the most slack, and admits, queues or rejects it (with a Retry-After
computed from the forecast). Everything here is synchronous and imports neither aiohttp, redis
nor prometheus_client, so the live gateway and the virtual-time replay drive the same objects.
"""

from gateway.admission.classes import ClassChoice, ClassSource, InvalidHeader, choose_class, client_deadline_s
from gateway.admission.config import (
    AdmissionSettings,
    ClassSettings,
    HeaderSettings,
    QueueSettings,
    RetryAfterSettings,
    ShadowSettings,
)
from gateway.admission.core import AdmissionController
from gateway.admission.decision import (
    Admit,
    Admitter,
    Blocker,
    Decision,
    Queue,
    Reject,
    RejectReason,
    Rule,
)
from gateway.admission.fairness import TenantKey, TokenWeights, VirtualTokenCounter
from gateway.admission.headers import decision_headers
from gateway.admission.policies import ADMITTERS, make_admitter
from gateway.admission.queue import AdmissionQueue, QueueEntry, Reevaluation
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import (
    RefusalReason,
    RetryAfter,
    RetryAfterPolicy,
    UniformSource,
    retry_after,
)
from gateway.admission.shares import ClassLoad, StreamingRequest
from gateway.admission.slo_admitter import SloAdmitter
from gateway.admission.stats import AdmissionStats, Outcome
from gateway.admission.views import ReplicaView

__all__ = [
    "ADMITTERS",
    "AdmissionController",
    "AdmissionQueue",
    "AdmissionRequest",
    "AdmissionSettings",
    "AdmissionStats",
    "Admit",
    "Admitter",
    "Blocker",
    "ClassChoice",
    "ClassLoad",
    "ClassSettings",
    "ClassSource",
    "Decision",
    "HeaderSettings",
    "InvalidHeader",
    "Outcome",
    "Queue",
    "QueueEntry",
    "QueueSettings",
    "Reevaluation",
    "RefusalReason",
    "Reject",
    "RejectReason",
    "ReplicaView",
    "RetryAfter",
    "RetryAfterPolicy",
    "RetryAfterSettings",
    "Rule",
    "ShadowSettings",
    "SloAdmitter",
    "StreamingRequest",
    "TenantKey",
    "TokenWeights",
    "UniformSource",
    "VirtualTokenCounter",
    "choose_class",
    "client_deadline_s",
    "decision_headers",
    "make_admitter",
    "retry_after",
]
