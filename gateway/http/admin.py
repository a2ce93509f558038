"""The admin surface: ``/metrics``, ``/metrics/replicas`` and ``/sluice/v1/*``, kept apart from
the public API by a listener of their own, a bearer token, or both (``admin:`` in the YAML).

``install_admin(app, store)`` returns the application the admin routes go on: ``app`` itself when
``admin.port`` is unset, else a second application served by ``AdminListener`` (the public one
then answers 404 on every admin path). ``/healthz`` and ``/readyz`` stay public. With
``admin.token_sha256`` (or ``tenants.auth.admin_token_hash``) set, every admin path needs
``Authorization: Bearer <token>``, compared by digest in constant time and read per request (a
reload applies at once); absent, malformed and wrong tokens get the same 401. Nothing here logs
or echoes a token. Operator guide: docs/tenants.md.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http.error_middleware import error_middleware
from gateway.http.errors import RouteNotFound, admin_token_required
from gateway.http.server_header import server_header_hook
from gateway.observability.logs import add_request_id_header, request_context_middleware
from gateway.tenants.auth import bearer_token
from gateway.tenants.keys import key_digest
from gateway.tenants.live import is_admin_path

__all__ = [
    "ADMIN_LISTENER",
    "ADMIN_SHUTDOWN_S",
    "AdminGate",
    "AdminGuard",
    "AdminListener",
    "admin_middleware",
    "install_admin",
    "is_admin_path",
]

log = logging.getLogger("sluice.admin")

#: Seconds the admin listener gives its in-flight requests (scrapes: milliseconds) when it stops.
ADMIN_SHUTDOWN_S: Final = 2.0


class AdminGuard:
    """Whether an ``Authorization`` header opens the admin routes, per the store's current settings.

    No token configured: always. Else only ``Bearer <token>`` whose SHA-256 digest equals the
    configured one, compared in constant time. The digest is recomputed once per settings
    snapshot (a reload may change the token).
    """

    def __init__(self, store: SettingsStore) -> None:
        self._store = store
        self._settings: Settings | None = None
        self._digest: bytes | None = None

    def __repr__(self) -> str:
        return f"AdminGuard(token={self.token_required})"

    @property
    def token_required(self) -> bool:
        """Whether the current settings name an admin token."""
        return self._current_digest() is not None

    def _current_digest(self) -> bytes | None:
        settings = self._store.current
        if settings is not self._settings:
            self._settings, self._digest = settings, settings.admin_token_digest()
        return self._digest

    def allowed(self, authorization: str | None) -> bool:
        """Whether a request carrying this raw ``Authorization`` value (``None``: absent) may read
        the admin routes."""
        expected = self._current_digest()
        if expected is None:
            return True
        token = None if authorization is None else bearer_token(authorization)
        if token is None:
            return False
        return hmac.compare_digest(key_digest(token), expected)


class AdminGate:
    """What one listener does with the admin paths (``is_admin_path``); other paths pass.

    ``serve_admin``: the listener serves the admin routes, so they need the token when one is
    configured (``admin_token_required``, 401). False (the public listener while a separate admin
    listener runs): they are 404 (``RouteNotFound``), token or not.
    """

    __slots__ = ("guard", "serve_admin")

    def __init__(self, store: SettingsStore, *, serve_admin: bool) -> None:
        self.guard = AdminGuard(store)
        self.serve_admin = serve_admin

    @classmethod
    def public(cls, store: SettingsStore) -> AdminGate:
        """The public listener's gate: it serves the admin routes unless ``admin.port`` is set
        (read once: restart required)."""
        return cls(store, serve_admin=store.current.admin.port is None)

    def check(self, request: web.Request) -> None:
        """Raise the ``GatewayError`` this listener answers ``request`` with when it is an admin
        request it refuses; return when it may go on."""
        if is_admin_path(request.path):
            if not self.serve_admin:
                raise RouteNotFound("no such route")
            if not self.guard.allowed(request.headers.get("Authorization")):
                raise admin_token_required()


def admin_middleware(store: SettingsStore, *, serve_admin: bool) -> Middleware:
    """Middleware factory for admin paths (``AdminGate``); other paths pass untouched. Install it
    inside ``error_middleware``, which turns its refusals into their OpenAI-style JSON bodies.
    """
    gate = AdminGate(store, serve_admin=serve_admin)

    @web.middleware
    async def impl(request: web.Request, handler: Handler) -> web.StreamResponse:
        gate.check(request)
        return await handler(request)

    return impl


class AdminListener:
    """The separate admin listener: its own ``web.Application`` (``app``, where the admin routes
    are added before startup) served on ``host:port``.

    ``start`` binds it (``OSError`` naming the admin address when it cannot); ``port`` is the bound
    port from then on (``port=0`` picks a free one). ``stop`` closes it, giving in-flight requests
    ``ADMIN_SHUTDOWN_S`` seconds.
    """

    def __init__(self, store: SettingsStore, host: str, port: int) -> None:
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.app = web.Application(
            middlewares=[
                request_context_middleware(store),
                error_middleware(),
                admin_middleware(store, serve_admin=True),
            ]
        )
        self.app.on_response_prepare.append(server_header_hook(store))
        self.app.on_response_prepare.append(add_request_id_header)
        self._guard = AdminGuard(store)
        self._runner: web.AppRunner | None = None
        #: Bind with SO_REUSEPORT, beside the other workers of ``server.workers`` > 1.
        self.reuse_port = False

    def __repr__(self) -> str:
        return f"AdminListener({self.host}:{self.port if self.port is not None else self._requested_port})"

    @property
    def url(self) -> str:
        """``http://host:port`` of the running listener (IPv6 hosts in brackets)."""
        if self.port is None:
            raise RuntimeError("the admin listener is not running")
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve. Raises ``OSError`` (errno kept) when the address cannot be bound."""
        runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, shutdown_timeout=ADMIN_SHUTDOWN_S
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._requested_port, reuse_port=self.reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            where = f"{self.host}:{self._requested_port}"
            raise OSError(exc.errno, f"admin listener on {where}: {exc.strerror or exc}") from exc
        self._runner = runner
        address = runner.addresses[0]
        self.port = int(address[1])
        protection = (
            "bearer token required"
            if self._guard.token_required
            else "no token: protected by its bind address only"
        )
        log.info("admin listener on %s (/metrics, /metrics/replicas, /sluice/v1/*): %s", self.url, protection)

    async def stop(self) -> None:
        """Stop serving; idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.port = None

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        """A ``cleanup_ctx`` for the public application: serve while it runs."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()


#: The separate admin listener of an application, present only when ``admin.port`` is set.
ADMIN_LISTENER: Final = web.AppKey("admin_listener", AdminListener)


def install_admin(
    app: web.Application, store: SettingsStore, *, gate: AdminGate | None = None
) -> web.Application:
    """Guard ``app``'s admin paths and return the application the admin routes go on (see the
    module docstring). Call before ``install_tenancy`` (the guard must run before its middleware)
    and append ``app[ADMIN_LISTENER].lifecycle`` to ``app.cleanup_ctx`` when it exists.

    ``gate``: ``app``'s own middleware already applies this gate (``AdminGate.public(store)``, as
    ``gateway.app.build_app``'s single middleware does, inside its error handling); else
    ``admin_middleware`` is appended to ``app.middlewares``. ``admin.host`` and ``admin.port`` are
    read here, once (restart required).
    """
    admin = store.current.admin
    serve_admin = admin.port is None
    if gate is None:
        app.middlewares.append(admin_middleware(store, serve_admin=serve_admin))
    elif gate.serve_admin != serve_admin:
        raise ValueError(f"admin gate serving admin routes: {gate.serve_admin}; admin.port: {admin.port}")
    if admin.port is None:
        if store.current.admin_token_digest() is None:
            log.info(
                "admin routes (/metrics, /sluice/v1/*) are served on the public listener without a "
                "token; in production set admin.port or admin.token_sha256"
            )
        return app
    listener = AdminListener(store, admin.host, admin.port)
    app[ADMIN_LISTENER] = listener
    return listener.app
