"""Sluice configuration: one pydantic v2 model per YAML section.

Every model forbids unknown keys and is frozen, so a loaded ``Settings`` is an immutable snapshot
that the reloader swaps as a whole. Units are in the field names (``_s`` seconds, ``_bytes``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveSeconds = Annotated[float, Field(gt=0)]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(Section):
    """The gateway's own listener and request limits."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    #: Largest request body accepted, in bytes; larger bodies get 413.
    max_body_bytes: Annotated[int, Field(gt=0)] = 8 * 1024 * 1024
    #: Time allowed to open a TCP connection to a replica, in seconds.
    upstream_connect_timeout_s: PositiveSeconds = 5.0
    #: Longest silence tolerated from a replica while waiting for headers or the next chunk,
    #: in seconds; after it the request fails with 502 (or an SSE error event mid-stream).
    upstream_read_timeout_s: PositiveSeconds = 600.0
    #: Time given to in-flight requests to finish on shutdown, in seconds.
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    #: Use uvloop's event loop when it is installed.
    uvloop: bool = True


class ReplicaSettings(Section):
    """One inference replica Sluice forwards to (started and owned by someone else)."""

    name: Name
    #: Base URL of the replica's OpenAI-compatible server, e.g. ``http://10.0.0.5:8000``.
    url: Annotated[str, Field(pattern=r"^https?://[^/\s]+(/[^\s]*)?$")]
    #: Which engine serves it; decides the metric dialect and error formats.
    backend: Literal["vllm"] = "vllm"


class EmulatorSettings(Section):
    """A replica emulator that Sluice starts itself as a child process (demo and development)."""

    name: Name
    #: Profile name under ``config/profiles/`` (without ``.yaml``) or a path to a profile file.
    profile: str = "llama3-8b-h100"
    port: Port
    host: str = "127.0.0.1"
    #: Seed for the emulator's jitter and output lengths; ``None`` means a random seed.
    seed: int | None = None
    #: Relative standard deviation of step-time jitter (0 = deterministic step times).
    jitter: Annotated[float, Field(ge=0, le=0.5)] = 0.0


class HealthSettings(Section):
    """Active health checks against each replica's ``/health``."""

    interval_s: PositiveSeconds = 2.0
    timeout_s: PositiveSeconds = 1.0
    #: Consecutive failed checks before a healthy replica is marked unhealthy.
    unhealthy_after: Annotated[int, Field(ge=1)] = 2
    #: Consecutive good checks before an unhealthy replica is marked healthy again.
    healthy_after: Annotated[int, Field(ge=1)] = 1


class ReloadSettings(Section):
    """Hot reload of the configuration file (SIGHUP always reloads)."""

    #: Poll the file's modification time and reload when it changes.
    watch: bool = True
    poll_interval_s: PositiveSeconds = 1.0


class LoggingSettings(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: One JSON object per line instead of human-readable text.
    json_format: bool = False
    #: Log one line per request (method, path, status, replica, duration, request id).
    access_log: bool = True


class Settings(Section):
    """The whole configuration file."""

    server: ServerSettings = ServerSettings()
    replicas: list[ReplicaSettings] = []
    emulators: list[EmulatorSettings] = []
    health: HealthSettings = HealthSettings()
    reload: ReloadSettings = ReloadSettings()
    logging: LoggingSettings = LoggingSettings()

    @model_validator(mode="after")
    def _replicas_are_consistent(self) -> Settings:
        if not self.replicas and not self.emulators:
            raise ValueError("at least one entry in `replicas` or `emulators` is required")
        names = [r.name for r in self.replicas] + [e.name for e in self.emulators]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"replica names must be unique, repeated: {', '.join(dupes)}")
        ports = [e.port for e in self.emulators]
        dup_ports = sorted({p for p in ports if ports.count(p) > 1})
        if dup_ports:
            raise ValueError(f"emulator ports must be unique, repeated: {dup_ports}")
        return self

    def all_replicas(self) -> list[ReplicaSettings]:
        """Static replicas plus one entry per emulator, in configuration order."""
        emulated = [
            ReplicaSettings(name=e.name, url=f"http://{e.host}:{e.port}", backend="vllm")
            for e in self.emulators
        ]
        return [*self.replicas, *emulated]
