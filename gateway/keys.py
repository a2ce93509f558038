"""The app keys of the services ``gateway.app`` builds and its plugins read back.

``gateway.app`` (the composition root; ``gateway.serve`` for the process's own, such as
``SHUTDOWN_GRACE``) sets these; plugins (``gateway.tenants.live``,
``gateway.observability.metrics``, ...) read them from the app. Both import them from here, so no
plugin imports the composition root. This module sits below every plugin: it imports only the
services' own modules. A plugin's own key lives with the plugin (``TENANCY``, ``ADMIN_LISTENER``,
``PROXY``, ``DISCONNECTS``, ``ADMISSION``), where its type is.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

from gateway.config.store import SettingsStore
from gateway.observability.outcome import RequestOutcome
from gateway.prediction.live import LivePredictions
from gateway.prediction.service import PredictionService
from gateway.replicas.emulators import EmulatorProcess
from gateway.replicas.health import HealthChecker
from gateway.replicas.registry import ReplicaRegistry
from gateway.replicas.scraper import MetricsScraper

#: Called once per proxied request when it is over; must not raise (errors are logged).
OutcomeListener = Callable[[RequestOutcome], None]

STORE = web.AppKey("store", SettingsStore)
SESSION = web.AppKey("session", aiohttp.ClientSession)
REGISTRY = web.AppKey("registry", ReplicaRegistry)
HEALTH = web.AppKey("health", HealthChecker)
EMULATORS: web.AppKey[list[EmulatorProcess]] = web.AppKey("emulators")
PREDICTION_SERVICE = web.AppKey("prediction_service", PredictionService)
SCRAPER = web.AppKey("scraper", MetricsScraper)
PREDICTIONS = web.AppKey("predictions", LivePredictions)
#: The shutdown grace ``run_gateway`` gave aiohttp (seconds); absent: the setting's current value.
SHUTDOWN_GRACE: web.AppKey[float] = web.AppKey("shutdown_grace")
#: Called with each proxied request's ``RequestOutcome`` when it is over; append before startup.
OUTCOME_LISTENERS: web.AppKey[list[OutcomeListener]] = web.AppKey("outcome_listeners")
