"""The replica sections of the configuration: ``replicas:``, ``emulators:``, ``health:``,
``scrape:`` and each replica's ``hardware:``.

Strict ``Section`` models (unknown keys rejected, frozen, every violation reported with its
path), mounted by ``gateway.config.settings.Settings`` as the other packages' sections are
(``gateway.admission.config``, ``gateway.limits.config``, ``gateway.tenants.config``). The
registry, health checker, scraper and emulator launcher read them; the predictor's roofline prior
is built from ``HardwareSettings``.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.section import (
    HF_ID,
    Host,
    Name,
    Port,
    PositiveSeconds,
    Section,
    SettingsViolations,
    Violation,
    not_above,
)
from gateway.tokens.files import tokenizer_file
from predictor.hardware import UNKNOWN_GPU, gpu_names, lookup_gpu
from predictor.model import lookup_model, model_names


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
        Literal["vllm", "tgi", "sglang", "auto"],
        Field(
            description="Which engine serves it (vllm, tgi, sglang); decides the metric dialect and error "
            "formats. auto: detect it from /metrics, else TGI's /info or SGLang's /get_server_info, "
            "and log what was detected."
        ),
    ] = "vllm"
    hardware: Annotated[
        HardwareSettings,
        Field(description="GPU, model and engine limits of the replica, for the latency predictor."),
    ] = HardwareSettings()
    api_key_env: Annotated[
        str | None,
        Field(
            pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
            description="Name of the environment variable holding the API key the replica was started "
            "with (vLLM's and SGLang's --api-key): every request Sluice sends it (proxied, health, "
            "models, metrics) carries `Authorization: Bearer <key>`; null sends none of Sluice's own.",
        ),
    ] = None
    tokenizer: Annotated[
        str | None,
        Field(
            min_length=1,
            description="Path to the tokenizer.json of the model the replica serves, or to a folder that "
            "holds one (a Hugging Face snapshot): prompts are then counted exactly instead of "
            'estimated (docs/predictor.md, "Prompt sizes"). null: looked up in the local Hugging Face '
            "cache by the served model's id and hardware.model; never downloaded.",
        ),
    ] = None

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str | None) -> str | None:
        # Checked when the configuration is loaded (and on every reload), so a wrong path refuses
        # the configuration instead of leaving the prompts estimated without a word.
        if value is not None and tokenizer_file(value) is None:
            raise ValueError("is neither a tokenizer.json file nor a folder that holds one")
        return value

    @model_validator(mode="after")
    def _api_key_is_set(self) -> ReplicaSettings:
        # Read when the configuration is loaded (and on every reload), so a missing key refuses
        # the configuration with this message instead of marking the replica unhealthy later.
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise SettingsViolations(
                [
                    Violation(
                        ("api_key_env",),
                        "names an environment variable that is unset or empty",
                        self.api_key_env,
                    )
                ]
            )
        return self

    def authorization(self) -> str | None:
        """The ``Authorization`` value for requests to this replica (``None``: no key configured).

        Read from the environment when called; the settings never hold the key itself, so the
        admin API, logs and errors cannot show it."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        return f"Bearer {key}" if key else None


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
    engine: Annotated[
        Literal["vllm", "tgi", "sglang"],
        Field(
            description="Which engine the emulator imitates: its /metrics names, info endpoint, native "
            "API and overload behaviour (the OpenAI routes are the same for all)."
        ),
    ] = "vllm"
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
    max_backoff_s: Annotated[
        PositiveSeconds,
        Field(
            description="Longest time between two checks of an unhealthy replica, in seconds: its checks "
            "back off from interval_s, doubling with each failure, up to this."
        ),
    ] = 30.0
    eject_after_timeouts: Annotated[
        int,
        Field(
            ge=1,
            description="Consecutive proxied requests that time out on a replica before it is ejected "
            "(outlier detection: its /health may still answer while generation is stuck).",
        ),
    ] = 2
    eject_s: Annotated[
        PositiveSeconds,
        Field(
            description="Seconds an ejected replica is kept out, whatever its health checks say; doubled "
            "for each ejection in a row (at most 60 s). Then healthy_after good checks bring it back."
        ),
    ] = 5.0

    @model_validator(mode="after")
    def _timeout_fits_interval(self) -> HealthSettings:
        # A check that may outlive the interval would overlap the next one to the same replica.
        if found := not_above(self, "timeout_s", "interval_s"):
            raise SettingsViolations(found)
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
        found = not_above(self, "timeout_s", "interval_s")
        # A rate needs two scrapes inside the window.
        if self.window_s < 2 * self.interval_s:
            message = f"must be at least twice interval_s ({2 * self.interval_s!r})"
            found.append(Violation(("window_s",), message, self.window_s))
        if found:
            raise SettingsViolations(found)
        return self
