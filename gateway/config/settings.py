"""Sluice configuration: one pydantic v2 model per YAML section.

Every model forbids unknown keys, is frozen and validates strictly (a quoted ``"8080"`` is not a
port), so a loaded ``Settings`` is an immutable, fully checked snapshot that the reloader swaps
whole. Units are in the field names (``_s`` seconds, ``_bytes``); each field's ``description``
states its meaning and unit, and ``config/sluice.example.yaml`` documents each key with its
default (a test keeps the two in step). Cross-field rules raise :class:`SettingsViolations`, one
:class:`Violation` per broken rule with a path relative to the model that raised it.

The sections that belong to one package live there and are mounted here: ``replicas:``,
``emulators:``, ``health:`` and ``scrape:`` (``gateway.replicas.config``), ``admission:``,
``limits:`` and ``tenants:``; this module holds ``server:``, ``reload:``, ``logging:``,
``admin:`` and the root ``Settings`` with its cross-section rules.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Final, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gateway.admission.config import AdmissionSettings
from gateway.config.section import (
    HF_ID,
    Host,
    Name,
    Port,
    PositiveSeconds,
    Section,
    SettingsViolations,
    Violation,
)
from gateway.ledger.config import LedgerSettings
from gateway.limits.config import LimitsSettings, TenantLimitSettings
from gateway.prediction.config import PredictionSettings
from gateway.replicas.config import (
    EmulatorSettings,
    HealthSettings,
    ReplicaSettings,
    ScrapeSettings,
)
from gateway.tenants.config import TenantsSettings, class_violations
from gateway.tenants.keys import KEY_HASH_PREFIX, REDACTED

__all__ = [
    "HF_ID",
    "Host",
    "Name",
    "Port",
    "PositiveSeconds",
    "Section",
    "SettingsViolations",
    "Violation",
]


class ServerSettings(Section):
    """The gateway's own listener and request limits."""

    host: Annotated[
        Host, Field(description="Address the gateway listens on (IP or host name). Restart required.")
    ] = "127.0.0.1"
    port: Annotated[
        int,
        Field(
            ge=0,
            le=65535,
            description="TCP port the gateway listens on; 0 picks a free port. Restart required.",
        ),
    ] = 8080
    max_body_bytes: Annotated[
        int, Field(gt=0, description="Largest request body accepted, in bytes; larger bodies get 413.")
    ] = 8 * 1024 * 1024
    max_json_depth: Annotated[
        int,
        Field(
            ge=2,
            le=512,
            description="Deepest nesting of arrays and objects a request body may have (its own object "
            "is 1); deeper bodies get 400 (request_too_complex) before they are decoded.",
        ),
    ] = 64
    max_json_items: Annotated[
        int,
        Field(
            ge=16,
            description="Most values a request body may hold in all its arrays and objects together "
            "(messages, content parts, prompt strings, token ids, tool definitions); more get 400 "
            "(request_too_complex) before they are decoded. Bounds the memory one body decodes to.",
        ),
    ] = 100_000
    upstream_connect_timeout_s: Annotated[
        PositiveSeconds, Field(description="Time allowed to open a TCP connection to a replica, in seconds.")
    ] = 5.0
    upstream_read_timeout_s: Annotated[
        PositiveSeconds,
        Field(
            description="Longest silence tolerated from a replica while waiting for headers or the next "
            "chunk, in seconds; after it the request fails with 502 (or an SSE error event mid-stream)."
        ),
    ] = 600.0
    client_write_timeout_s: Annotated[
        PositiveSeconds,
        Field(
            description="Longest wait for a client to take one streamed event (a write waiting for the "
            "connection's buffers to drain), in seconds; after it the client counts as gone: its "
            "connection is aborted and the replica's request closed, freeing the slot."
        ),
    ] = 60.0
    client_read_timeout_s: Annotated[
        PositiveSeconds,
        Field(
            le=3600,
            description="Longest time a client may take to send a request's whole body once its headers "
            "arrived, in seconds; past it the gateway answers 408 (request_timeout) and closes the "
            "connection, before any tenant budget or replica is involved. Bounds body dribblers.",
        ),
    ] = 30.0
    shutdown_grace_s: Annotated[
        float,
        Field(
            ge=0,
            description="Time given to in-flight requests to finish on shutdown, in seconds; a stream still "
            "running just before it ends gets an SSE error event (code server_shutting_down) and is settled.",
        ),
    ] = 10.0
    drain_s: Annotated[
        float,
        Field(
            ge=0,
            le=300,
            description="On SIGTERM, time spent draining before the listener closes, in seconds: /readyz "
            "answers 503 and new completion requests get 503 (Retry-After) while requests in flight go on, "
            "so a load balancer stops sending first. 0: close at once.",
        ),
    ] = 0.0
    uvloop: Annotated[
        bool, Field(description="Use uvloop's event loop when it is installed. Restart required.")
    ] = True
    workers: Annotated[
        int,
        Field(
            ge=1,
            le=256,
            description="Gateway processes serving the one port (SO_REUSEPORT), under a supervisor that "
            "starts them, restarts one that dies (with back-off), passes SIGTERM, SIGINT and SIGHUP on and "
            "sums their /metrics. More than 1 needs a fixed server.port (and admin.port, when set) and "
            "limits.redis, where the workers share their view of the replicas (ledger.enabled) and, with "
            "limits.backend: redis, one budget per tenant (memory: each worker keeps 1/N of every tenant "
            "budget). `sluice serve --workers N` sets it. Restart required.",
        ),
    ] = 1
    server_header: Annotated[
        str,
        Field(
            min_length=1,
            max_length=64,
            pattern=r"^[!-~]+( [!-~]+)*$",
            description="The value of the Server header on every response (public and admin listeners): "
            "printable ASCII words, at most 64 characters. It replaces aiohttp's, which names the Python "
            "and aiohttp versions.",
        ),
    ] = "sluice"
    allow_unauthenticated: Annotated[
        bool,
        Field(
            description="Allow listening beyond loopback (a host other than 127.0.0.0/8, ::1 or localhost) "
            "with no tenant configured, where anyone who reaches the port is served without a key. "
            "`sluice serve --allow-unauthenticated` sets it. Restart required.",
        ),
    ] = False

    def loopback_only(self) -> bool:
        """Whether ``host`` accepts connections from this machine only (127.0.0.0/8, ::1,
        ``localhost``); a host name other than ``localhost`` counts as reachable from outside."""
        host = self.host.removeprefix("[").removesuffix("]")
        if host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


class ReloadSettings(Section):
    """Hot reload of the configuration file (SIGHUP always reloads)."""

    watch: Annotated[
        bool, Field(description="Poll the file (mtime, size, inode) and reload when it changes.")
    ] = True
    poll_interval_s: Annotated[
        PositiveSeconds, Field(description="Time between two polls of the file, in seconds.")
    ] = 1.0


class LoggingSettings(Section):
    """What the gateway logs and how."""

    level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR"],
        Field(description="Lowest level of log records emitted."),
    ] = "INFO"
    json_format: Annotated[
        bool, Field(description="One JSON object per line instead of human-readable text.")
    ] = False
    access_log: Annotated[
        bool,
        Field(
            description="Log one line per request (method, path, status, replica, duration, request id). "
            "Lines are buffered and written together at most every 10 ms, at once before a warning, "
            "and at exit."
        ),
    ] = True
    repeat_window_s: Annotated[
        float,
        Field(
            ge=0,
            le=3600,
            allow_inf_nan=False,
            description="Window of the rate limit on repeated log lines, in seconds: the first line of a "
            "kind (same logger, level and message, or the same error apart from its request id) is "
            "written; more of it within the window are counted, then one line says how many "
            '("... (repeated 1502 times in the last 10 s)"). The access log is never thinned. '
            "0 writes every line.",
        ),
    ] = 10.0


#: ``admin.token_sha256``: 64 hex digits, optionally after ``sha256:`` (what ``sluice hash-key`` prints).
_TOKEN_SHA256: Final = re.compile(r"^(?:sha256:)?[0-9a-fA-F]{64}$")
#: Bind addresses that listen on every interface, so they clash with any other host on one port.
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", "[::]", "*"})


def _same_listener(host_a: str, host_b: str) -> bool:
    """Whether two bind hosts may need the same port: equal, or either one is a wildcard."""
    return host_a == host_b or host_a in _WILDCARD_HOSTS or host_b in _WILDCARD_HOSTS


class AdminSettings(Section):
    """Where ``/metrics``, ``/metrics/replicas`` and ``/sluice/v1/*`` are served and who may read
    them. ``/healthz`` and ``/readyz`` always stay on the public listener, unprotected; ``/readyz``
    lists the replicas only to a caller who may read the admin routes there."""

    # A token pasted in plaintext (or under a misspelt key) must not be echoed in an error.
    model_config = ConfigDict(hide_input_in_errors=True)

    host: Annotated[
        Host,
        Field(description="Address of the admin listener (used only when port is set). Restart required."),
    ] = "127.0.0.1"
    port: Annotated[
        int | None,
        Field(
            ge=0,
            le=65535,
            description="TCP port of a separate admin listener; when set, the admin routes are served "
            "only there and answer 404 on the public listener; 0 picks a free port; null serves them on "
            "the public listener. Restart required.",
        ),
    ] = None
    token_sha256: Annotated[
        str | None,
        Field(
            repr=False,
            description="Hex SHA-256 of the bearer token the admin routes require (`sluice hash-key` "
            "prints it as sha256:<hex>; either form is accepted); null: no token (then protect them by "
            "the bind address). Hot-reloadable.",
        ),
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _redact_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(key not in cls.model_fields for key in data):
            return {key: value if key in cls.model_fields else REDACTED for key, value in data.items()}
        return data

    @field_validator("token_sha256", mode="before")
    @classmethod
    def _token_hash(cls, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise SettingsViolations([Violation((), "should be a hex SHA-256 string", REDACTED)])
        if not _TOKEN_SHA256.match(value):
            raise SettingsViolations(
                [
                    Violation(
                        (),
                        "not a SHA-256 hash (64 hex digits, optionally after sha256:); a plaintext token "
                        "is never stored: run `sluice hash-key` and put what it prints here",
                        REDACTED,
                    )
                ]
            )
        return value.removeprefix(KEY_HASH_PREFIX).lower()

    def token_digest(self) -> bytes | None:
        """The 32-byte SHA-256 digest of the admin token; ``None`` when no token is set here."""
        return None if self.token_sha256 is None else bytes.fromhex(self.token_sha256)


class Settings(Section):
    """The whole configuration file."""

    server: Annotated[ServerSettings, Field(description="The gateway's own listener and request limits.")] = (
        ServerSettings()
    )
    replicas: Annotated[
        list[ReplicaSettings], Field(description="Inference replicas started and owned by someone else.")
    ] = []
    emulators: Annotated[
        list[EmulatorSettings],
        Field(description="Replica emulators Sluice starts itself as child processes. Restart required."),
    ] = []
    health: Annotated[HealthSettings, Field(description="Active health checks of every replica.")] = (
        HealthSettings()
    )
    scrape: Annotated[
        ScrapeSettings, Field(description="Scraping of every replica's /metrics. Restart required.")
    ] = ScrapeSettings()
    reload: Annotated[ReloadSettings, Field(description="Hot reload of the configuration file.")] = (
        ReloadSettings()
    )
    logging: Annotated[LoggingSettings, Field(description="Log level and format.")] = LoggingSettings()
    admission: Annotated[
        AdmissionSettings,
        Field(description="SLO-aware admission: request classes, their targets, the gateway queue."),
    ] = AdmissionSettings()
    tenants: Annotated[
        TenantsSettings, Field(description="API keys, tenants, their fair-share weights and limits.")
    ] = TenantsSettings()
    limits: Annotated[
        LimitsSettings, Field(description="Where tenant token buckets live (memory or Redis).")
    ] = LimitsSettings()
    admin: Annotated[
        AdminSettings,
        Field(description="Listener and bearer token of /metrics and the /sluice/v1/* admin endpoints."),
    ] = AdminSettings()
    prediction: Annotated[
        PredictionSettings, Field(description="Latency prediction: the measured forecast correction.")
    ] = PredictionSettings()
    ledger: Annotated[
        LedgerSettings,
        Field(
            description="The replica ledger: every gateway's in-flight requests per replica, shared through "
            "limits.redis. Restart required."
        ),
    ] = LedgerSettings()

    @model_validator(mode="after")
    def _replicas_are_consistent(self) -> Settings:
        violations = [
            *self._missing_replicas(),
            *self._repeated_names(),
            *self._emulator_port_clashes(),
            *class_violations(self.tenants, self.admission.classes, prefix=("tenants",)),
            *self._admin_violations(),
            *self._open_beyond_loopback(),
            *self._ledger_violations(),
            *self._worker_violations(),
        ]
        if violations:
            raise SettingsViolations(violations)
        return self

    def _ledger_violations(self) -> list[Violation]:
        """``ledger.enabled`` without ``limits.redis``: the ledger lives on the limiter's Redis."""
        if not self.ledger.enabled or self.limits.redis is not None:
            return []
        message = "needs limits.redis (the ledger uses the limiter's Redis)"
        return [Violation(("ledger", "enabled"), message, True)]

    def _missing_replicas(self) -> list[Violation]:
        if self.replicas or self.emulators:
            return []
        return [Violation(("replicas",), "at least one entry in `replicas` or `emulators` is required", [])]

    def _repeated_names(self) -> list[Violation]:
        """Every name after its first use, across replicas then emulators."""
        first: dict[str, str] = {}
        found: list[Violation] = []
        entries: list[tuple[str, int, str]] = [("replicas", i, r.name) for i, r in enumerate(self.replicas)]
        entries += [("emulators", i, e.name) for i, e in enumerate(self.emulators)]
        for section, index, name in entries:
            where = f"{section}.{index}.name"
            if name in first:
                found.append(
                    Violation((section, index, "name"), f"duplicate name, first used at {first[name]}", name)
                )
            else:
                first[name] = where
        return found

    def _emulator_port_clashes(self) -> list[Violation]:
        """Emulator ports used twice, or equal to the gateway's own port."""
        first: dict[int, str] = {}
        if self.server.port != 0:
            first[self.server.port] = "server.port"
        found: list[Violation] = []
        for index, emulator in enumerate(self.emulators):
            if emulator.port in first:
                message = f"port already used by {first[emulator.port]}"
                found.append(Violation(("emulators", index, "port"), message, emulator.port))
            else:
                first[emulator.port] = f"emulators.{index}.port"
        return found

    @property
    def authenticates_no_one(self) -> bool:
        """No tenant is configured: API keys are not looked at and every request is served."""
        return not self.tenants.tenants

    def _open_beyond_loopback(self) -> list[Violation]:
        """Listening beyond loopback while authenticating no one, unless explicitly allowed."""
        server = self.server
        if not self.authenticates_no_one or server.loopback_only() or server.allow_unauthenticated:
            return []
        message = (
            "no tenant is configured, so anyone who reaches this address is served without a key: "
            "configure tenants, listen on 127.0.0.1, or set server.allow_unauthenticated: true "
            "(sluice serve --allow-unauthenticated)"
        )
        return [Violation(("server", "host"), message, server.host)]

    def _worker_violations(self) -> list[Violation]:
        """``server.workers`` > 1 with a port picked at random (0): each worker would pick its own;
        or without ``limits.redis``: no ledger could give the workers one view of the replicas,
        and each would admit as if it were alone."""
        workers = self.server.workers
        if workers == 1:
            return []
        found: list[Violation] = []
        if self.limits.redis is None:
            message = (
                f"{workers} workers need limits.redis: there they share their in-flight requests "
                "(ledger.enabled: true); without it each would admit with its own requests only, "
                f"together up to {workers} times a replica's headroom in a burst "
                "(docs/deployment.md, Workers)"
            )
            found.append(Violation(("server", "workers"), message, workers))
        for path, port in (("server", self.server.port), ("admin", self.admin.port)):
            if port == 0:
                message = f"0 picks a different free port in each of the {workers} workers: give a fixed port"
                found.append(Violation((path, "port"), message, port))
        return found

    def limited_tenants(self) -> list[str]:
        """The tenants with at least one budget (``tenants.*.limits``), by name."""
        unlimited = TenantLimitSettings()
        return sorted(name for name, t in self.tenants.tenants.items() if t.limits != unlimited)

    def _admin_violations(self) -> list[Violation]:
        """An admin port another listener of this file needs, and an admin token that disagrees
        with ``tenants.auth.admin_token_hash`` or is also a tenant's API key (values redacted)."""
        admin, found = self.admin, []
        if admin.port:
            taken = [("server.port", self.server.host, self.server.port)]
            taken += [(f"emulators.{i}.port", e.host, e.port) for i, e in enumerate(self.emulators)]
            for where, host, port in taken:
                if port == admin.port and _same_listener(host, admin.host):
                    message = f"port already used by {where} (on host {host!r})"
                    found.append(Violation(("admin", "port"), message, admin.port))
                    break
        digest = admin.token_digest()
        if digest is None:
            return found
        legacy = self.tenants.auth.admin_token_hash
        if legacy is not None and bytes.fromhex(legacy.removeprefix(KEY_HASH_PREFIX)) != digest:
            message = (
                "differs from tenants.auth.admin_token_hash; both name the one admin token: set only one"
            )
            found.append(Violation(("admin", "token_sha256"), message, REDACTED))
        tenant_keys = {
            key.removeprefix(KEY_HASH_PREFIX) for t in self.tenants.tenants.values() for key in t.api_keys
        }
        if admin.token_sha256 in tenant_keys:
            message = "is also a tenant's API key; the admin token must be a secret of its own"
            found.append(Violation(("admin", "token_sha256"), message, REDACTED))
        return found

    def admin_token_digest(self) -> bytes | None:
        """The SHA-256 digest of the token the admin routes require: ``admin.token_sha256``, else
        the older ``tenants.auth.admin_token_hash``; ``None`` when neither is set (no token)."""
        digest = self.admin.token_digest()
        legacy = self.tenants.auth.admin_token_hash
        if digest is None and legacy is not None:
            return bytes.fromhex(legacy.removeprefix(KEY_HASH_PREFIX))
        return digest

    def all_replicas(self) -> list[ReplicaSettings]:
        """Static replicas plus one entry per emulator, in configuration order."""
        emulated = [
            ReplicaSettings(
                name=e.name, url=f"http://{e.host}:{e.port}", backend=e.engine, hardware=e.hardware
            )
            for e in self.emulators
        ]
        return [*self.replicas, *emulated]
