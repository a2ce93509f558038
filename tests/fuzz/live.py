"""A real gateway on a real port, in front of real-HTTP replicas, for blocking HTTP clients.

Schemathesis and raw sockets send requests synchronously, so the gateway cannot share the test's
event loop: ``serve_gateway`` runs an event loop in a thread of its own, starts there a
``FakeReplica`` (``tests.unit.gateway.fakes``: a healthy replica answering instantly, so that any
5xx is Sluice's own), the replica emulator (``simulator.server``, real vLLM-like validation: it
refuses ``n`` > 1 with a 400) and the emulator as TGI (native ``/generate`` routes, serving
``TGI_MODEL``), then the gateway (``build_app``, plus ``install_openapi`` if it lacks it) with one
tenant and an admin token, all on free ports of 127.0.0.1, and tears them down in reverse.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from gateway.admission.config import ShadowSettings
from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.http.openapi import OPENAPI_PATH, install_openapi
from gateway.http.parse_errors import install as install_parse_errors
from gateway.replicas.config import ReplicaSettings
from gateway.tenants import AuthSettings, TenantSettings, TenantsSettings, hash_api_key
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings

T = TypeVar("T")

#: The tenant's API key, and the admin token guarding ``/metrics`` and ``/sluice/v1/*``.
API_KEY = "sk-fuzz-tenant-5e1f0c2a9b"
ADMIN_TOKEN = "sk-fuzz-admin-7d4b3a61c0"
#: Bodies over this many bytes get a 413 (small, so the test sends little).
MAX_BODY_BYTES = 64 * 1024
#: The emulator's profile; it serves ``EMULATED_MODEL``.
EMULATOR_PROFILE = "llama3-8b-h100"
#: The model the TGI emulator serves (its own: native requests go to the one TGI model).
TGI_MODEL = "tgi-fuzz-model"
#: Seconds any one start-up or tear-down step may take before the harness gives up.
STEP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LiveGateway:
    """The running gateway: its base URL, its app, the fake replica, and the emulated model."""

    url: str
    host: str
    port: int
    app: web.Application
    replica: FakeReplica
    emulated_model: str

    def routes(self, method: str, path: str) -> bool:
        """True when the gateway has a route for ``method path`` (not only a 404/405)."""
        return any(
            route.method == method and route.resource is not None and route.resource.canonical == path
            for route in self.app.router.routes()
        )


def ensure_openapi(app: web.Application) -> None:
    """``install_openapi(app)`` unless ``build_app`` already did (``GET /openapi.json`` routed)."""
    if not any(
        route.method == "GET" and route.resource is not None and route.resource.canonical == OPENAPI_PATH
        for route in app.router.routes()
    ):
        install_openapi(app)


def fuzz_settings(fake_url: str, emulator_url: str, tgi_url: str) -> Settings:
    """The three replicas, one unlimited tenant (``API_KEY``), an admin token, ``MAX_BODY_BYTES``;
    admission's SLO, stream-protection and isolation rules in shadow (decided, never enforced)."""
    base = gateway_settings({"fake": fake_url, "emulator": emulator_url})
    replicas = [*base.replicas, ReplicaSettings(name="tgi", url=tgi_url, backend="tgi")]
    tenants = TenantsSettings(
        auth=AuthSettings(admin_token_hash=hash_api_key(ADMIN_TOKEN)),
        tenants={"fuzz": TenantSettings(api_keys=[hash_api_key(API_KEY)])},
    )
    # Load-dependent rules in shadow: a busy CI machine must not turn a case into a 429.
    shadow = ShadowSettings(slo=True, protect_streams=True, batch_isolation=True)
    return base.model_copy(
        update={
            "admission": base.admission.model_copy(update={"shadow": shadow}),
            "replicas": replicas,
            "tenants": tenants,
            "server": ServerSettings(port=0, max_body_bytes=MAX_BODY_BYTES),
        }
    )


async def _serve(app: web.Application) -> tuple[web.AppRunner, str, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, str(host), int(port)


@contextmanager
def serve_gateway() -> Iterator[LiveGateway]:
    """Start the replicas and the gateway in a background event loop; stop them on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-gateway", daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=STEP_TIMEOUT_S)

    runners: list[web.AppRunner] = []
    try:
        replica = FakeReplica()
        fake_runner, host, fake_port = run(_serve(replica.app()))
        runners.append(fake_runner)
        profile = load_profile(EMULATOR_PROFILE)
        emulator_runner, _, emulator_port = run(_serve(build_emulator(profile, seed=0)))
        runners.append(emulator_runner)
        tgi_profile = profile.model_copy(update={"served_model_name": TGI_MODEL})
        tgi_runner, _, tgi_port = run(_serve(build_emulator(tgi_profile, seed=0, engine="tgi")))
        runners.append(tgi_runner)
        settings = fuzz_settings(
            f"http://{host}:{fake_port}", f"http://{host}:{emulator_port}", f"http://{host}:{tgi_port}"
        )
        app = build_app(SettingsStore(settings), spawn_emulators=False)
        ensure_openapi(app)
        # As ``sluice serve`` does: what aiohttp cannot parse gets Sluice's JSON 400 (process-wide).
        install_parse_errors()
        gateway_runner, _, port = run(_serve(app))
        runners.append(gateway_runner)
        yield LiveGateway(
            url=f"http://{host}:{port}",
            host=host,
            port=port,
            app=app,
            replica=replica,
            emulated_model=profile.served_model_name,
        )
    finally:
        for runner in reversed(runners):
            run(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=STEP_TIMEOUT_S)
        loop.close()


__all__ = ["ADMIN_TOKEN", "API_KEY", "MAX_BODY_BYTES", "MODEL", "TGI_MODEL", "LiveGateway", "serve_gateway"]
