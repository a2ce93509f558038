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

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gateway.admission.config import AdmissionSettings
from gateway.limits.config import LimitsSettings
from gateway.section import (
    HF_ID,
    Host,
    Name,
    Port,
    PositiveSeconds,
    Section,
    SettingsViolations,
    Violation,
)
from gateway.tenants.config import TenantsSettings, class_violations
from predictor.hardware import UNKNOWN_GPU, gpu_names, lookup_gpu
from predictor.model import lookup_model, model_names

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


class HardwareSettings(Section):
    """What the operator knows about a replica's hardware and engine limits (vLLM does not expose
    them); the predictor builds its roofline prior from them. Every key may be left out: a replica
    without a known GPU and model is learned from its own metrics alone."""

    gpu: Annotated[
        str | None,
        Field(
            description="GPU kind of one device, a name from the predictor's table (e.g. H100-SXM) or the "
            "name nvidia-smi prints; null or 'unknown' means learn the replica's speed from its metrics."
        ),
    ] = None
    model: Annotated[
        str | None,
        Field(
            description="Model served, a name from the predictor's catalogue (e.g. Llama-3-8B) or a Hugging "
            "Face id (owner/name); null means learn from the replica's metrics."
        ),
    ] = None
    tensor_parallel: Annotated[
        int, Field(ge=1, description="GPUs one replica spans (vLLM --tensor-parallel-size).")
    ] = 1
    max_num_seqs: Annotated[
        int | None,
        Field(
            ge=1,
            description="Most sequences in one engine step (vLLM --max-num-seqs); null means the "
            "predictor's default assumption (256).",
        ),
    ] = None
    max_num_batched_tokens: Annotated[
        int | None,
        Field(
            ge=1,
            description="Token budget of one engine step (vLLM --max-num-batched-tokens); null means the "
            "predictor's default assumption (8192).",
        ),
    ] = None

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None and lookup_gpu(value) is None:
            known = [name for name in gpu_names() if lookup_gpu(name) is not UNKNOWN_GPU]
            raise ValueError(f"unknown GPU; known: {', '.join(known)} (or 'unknown')")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str | None) -> str | None:
        if value is not None and lookup_model(value) is None and not HF_ID.match(value):
            raise ValueError(
                f"neither a catalogue model ({', '.join(model_names())}) nor a Hugging Face id (owner/name)"
            )
        return value

    @model_validator(mode="after")
    def _budget_holds_a_step(self) -> HardwareSettings:
        # vLLM refuses to start with a token budget smaller than its sequence limit.
        seqs, budget = self.max_num_seqs, self.max_num_batched_tokens
        if seqs is not None and budget is not None and budget < seqs:
            raise SettingsViolations(
                [Violation(("max_num_batched_tokens",), f"must be at least max_num_seqs ({seqs})", budget)]
            )
        return self

    def canonical_gpu(self) -> str | None:
        """The predictor's canonical name for ``gpu``; ``None`` when unset or unknown hardware."""
        spec = None if self.gpu is None else lookup_gpu(self.gpu)
        return None if spec is None or spec is UNKNOWN_GPU else spec.name


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
    hardware: Annotated[
        HardwareSettings,
        Field(description="GPU, model and engine limits of the replica, for the latency predictor."),
    ] = HardwareSettings()


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
    hardware: Annotated[
        HardwareSettings,
        Field(
            description="What the predictor is told about the emulated hardware (it never reads the profile)."
        ),
    ] = HardwareSettings()


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


class ScrapeSettings(Section):
    """Scraping of every replica's ``/metrics`` for the latency predictor. Restart required."""

    interval_s: Annotated[
        PositiveSeconds, Field(description="Time between two scrapes of one replica, in seconds.")
    ] = 1.0
    timeout_s: Annotated[
        PositiveSeconds,
        Field(
            description="Time one scrape may take before the replica's metrics count as stale, in seconds."
        ),
    ] = 1.0
    window_s: Annotated[
        PositiveSeconds,
        Field(description="Span of scrapes that rates and histogram statistics cover, in seconds."),
    ] = 10.0

    @model_validator(mode="after")
    def _timing_is_coherent(self) -> ScrapeSettings:
        found: list[Violation] = []
        if self.timeout_s > self.interval_s:
            found.append(
                Violation(("timeout_s",), f"must not exceed interval_s ({self.interval_s!r})", self.timeout_s)
            )
        # A rate needs two scrapes inside the window.
        if self.window_s < 2 * self.interval_s:
            message = f"must be at least twice interval_s ({2 * self.interval_s!r})"
            found.append(Violation(("window_s",), message, self.window_s))
        if found:
            raise SettingsViolations(found)
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

    @model_validator(mode="after")
    def _replicas_are_consistent(self) -> Settings:
        violations = [
            *self._missing_replicas(),
            *self._repeated_names(),
            *self._emulator_port_clashes(),
            *class_violations(self.tenants, self.admission.classes, prefix=("tenants",)),
        ]
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
            ReplicaSettings(name=e.name, url=f"http://{e.host}:{e.port}", backend="vllm", hardware=e.hardware)
            for e in self.emulators
        ]
        return [*self.replicas, *emulated]
