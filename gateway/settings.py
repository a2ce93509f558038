"""Sluice configuration: one pydantic v2 model per YAML section.

Every model forbids unknown keys, is frozen and validates strictly (a quoted ``"8080"`` is not a
port, ``yes`` is not a timeout), so a loaded ``Settings`` is an immutable, fully checked snapshot
that the reloader swaps as a whole. Units are in the field names (``_s`` seconds, ``_bytes``);
every field's ``description`` states its meaning and unit, and ``config/sluice.example.yaml``
documents each key with its default (a test keeps the two in step).

Cross-field rules raise :class:`SettingsViolations`, which carries one :class:`Violation` per
broken rule with a path relative to the model that raised it, so ``gateway.config`` can report
``emulators.1.port: ...`` rather than a bare "value error" on the whole file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveSeconds = Annotated[float, Field(gt=0)]
#: A host name or IP address: non-empty, no whitespace.
Host = Annotated[str, Field(pattern=r"^\S+$")]


@dataclass(frozen=True)
class Violation:
    """One broken cross-field rule.

    ``path`` is relative to the model whose validator found it (``("timeout_s",)`` inside
    ``health``); ``value`` is the offending value, shown to the operator.
    """

    path: tuple[str | int, ...]
    message: str
    value: object


class SettingsViolations(ValueError):
    """Raised by model validators; carries every cross-field violation found, not just the first."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        super().__init__(
            "; ".join(
                f"{'.'.join(str(p) for p in v.path) or '(top level)'}: {v.message} (got {v.value!r})"
                for v in self.violations
            )
        )


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable, types are strict."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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
    shutdown_grace_s: Annotated[
        float, Field(ge=0, description="Time given to in-flight requests to finish on shutdown, in seconds.")
    ] = 10.0
    uvloop: Annotated[
        bool, Field(description="Use uvloop's event loop when it is installed. Restart required.")
    ] = True


class ReplicaSettings(Section):
    """One inference replica Sluice forwards to (started and owned by someone else)."""

    name: Annotated[Name, Field(description="Unique replica name, used in logs and metric labels.")]
    url: Annotated[
        str,
        Field(
            pattern=r"^https?://[^/\s]+(/[^\s]*)?$",
            description="Base URL of the replica's OpenAI-compatible server, e.g. http://10.0.0.5:8000.",
        ),
    ]
    backend: Annotated[
        Literal["vllm"],
        Field(description="Which engine serves it; decides the metric dialect and error formats."),
    ] = "vllm"


class EmulatorSettings(Section):
    """A replica emulator that Sluice starts itself as a child process (demo and development)."""

    name: Annotated[Name, Field(description="Unique replica name, shared with `replicas` names.")]
    profile: Annotated[
        str,
        Field(
            min_length=1,
            description="Profile name under config/profiles/ (without .yaml) or a path to a profile file.",
        ),
    ] = "llama3-8b-h100"
    port: Annotated[Port, Field(description="TCP port the emulator listens on.")]
    host: Annotated[Host, Field(description="Address the emulator listens on.")] = "127.0.0.1"
    seed: Annotated[
        int | None,
        Field(
            ge=0, description="Seed for the emulator's jitter and output lengths; null means a random seed."
        ),
    ] = None
    jitter: Annotated[
        float,
        Field(
            ge=0,
            le=0.5,
            description="Relative standard deviation of step-time jitter (0 = deterministic step times).",
        ),
    ] = 0.0


class HealthSettings(Section):
    """Active health checks against each replica's ``/health``."""

    interval_s: Annotated[
        PositiveSeconds, Field(description="Time between two checks of one replica, in seconds.")
    ] = 2.0
    timeout_s: Annotated[
        PositiveSeconds, Field(description="Time a check may take before it counts as failed, in seconds.")
    ] = 1.0
    unhealthy_after: Annotated[
        int,
        Field(ge=1, description="Consecutive failed checks before a healthy replica is marked unhealthy."),
    ] = 2
    healthy_after: Annotated[
        int,
        Field(
            ge=1, description="Consecutive good checks before an unhealthy replica is marked healthy again."
        ),
    ] = 1

    @model_validator(mode="after")
    def _timeout_fits_interval(self) -> HealthSettings:
        # A check that may outlive the interval would overlap the next one to the same replica.
        if self.timeout_s > self.interval_s:
            raise SettingsViolations(
                [
                    Violation(
                        ("timeout_s",), f"must not exceed interval_s ({self.interval_s!r})", self.timeout_s
                    )
                ]
            )
        return self


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
        Field(description="Log one line per request (method, path, status, replica, duration, request id)."),
    ] = True


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
    reload: Annotated[ReloadSettings, Field(description="Hot reload of the configuration file.")] = (
        ReloadSettings()
    )
    logging: Annotated[LoggingSettings, Field(description="Log level and format.")] = LoggingSettings()

    @model_validator(mode="after")
    def _replicas_are_consistent(self) -> Settings:
        violations = [*self._missing_replicas(), *self._repeated_names(), *self._emulator_port_clashes()]
        if violations:
            raise SettingsViolations(violations)
        return self

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

    def all_replicas(self) -> list[ReplicaSettings]:
        """Static replicas plus one entry per emulator, in configuration order."""
        emulated = [
            ReplicaSettings(name=e.name, url=f"http://{e.host}:{e.port}", backend="vllm")
            for e in self.emulators
        ]
        return [*self.replicas, *emulated]
