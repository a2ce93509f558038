"""TGI (text-generation-inference) as the emulator shows it: ``/metrics``, ``/info``, native bodies.

Pure (no I/O; ``simulator.native`` serves it). ``TgiMetrics`` writes the exposition text itself,
as TGI's Rust exporter does: counters without ``_total`` and without a model label, a series only
once recorded, ``# TYPE`` lines only, TGI's buckets. Sources (``shared/reference/backend-metrics.md``
§2, TGI's router v3), what is recorded when, and what is not emitted: docs/emulator.md.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np

from simulator.engine import FinishedRequestStats, StepPlan, StepResult

#: TGI's last release tag when the reference was written (``/info.version``).
TGI_VERSION: Final = "3.3.7"
#: TGI's launcher default for ``--max-concurrent-requests``.
DEFAULT_MAX_CONCURRENT_REQUESTS: Final = 128
#: TGI's default ``max_new_tokens`` (``GenerateParameters``, openapi default "100").
DEFAULT_MAX_NEW_TOKENS: Final = 100
#: ``x-compute-type``: TGI's ``COMPUTE_TYPE`` environment default.
COMPUTE_TYPE: Final = "gpu+optimized"

#: Duration buckets of every ``*_duration`` histogram (router ``server.rs``).
DURATION_BUCKETS: Final = tuple(0.0001 * 1.5**k for k in range(1, 36))
#: ``tgi_batch_next_size`` buckets: 1..1024 step 1.
BATCH_SIZE_BUCKETS: Final = tuple(float(i) for i in range(1, 1025))

#: The body of TGI's 429 when ``max_concurrent_requests`` permits are all taken.
OVERLOADED_BODY: Final = {"error": "Model is overloaded", "error_type": "overloaded"}

CONTENT_TYPE: Final = "text/plain; charset=utf-8"


def token_buckets(maximum: int) -> tuple[float, ...]:
    """TGI's token-count buckets: ``maximum / 100`` x 1..100."""
    return tuple(maximum / 100 * i for i in range(1, 101))


def rust_number(value: float) -> str:
    """A number as Rust's ``Display`` writes an ``f64``: the shortest digits that read back the
    same, always positional (``0.00005351``, never ``5.351e-05``), no fraction when integral."""
    if float(value).is_integer():
        return str(int(value))
    return str(np.format_float_positional(float(value), unique=True, trim="-"))


class TgiEngineView(Protocol):
    """What the TGI metrics read from the engine at scrape time."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def reserved_tokens(self) -> int: ...


@dataclass(slots=True)
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1


Labels = tuple[tuple[str, str], ...]


class TgiMetrics:
    """One emulated TGI router's metrics; ``exposition()`` renders them as TGI would."""

    def __init__(
        self,
        *,
        engine: TgiEngineView,
        max_input_tokens: int,
        max_total_tokens: int,
        kv_capacity_tokens: int,
    ) -> None:
        self._engine = engine
        self._capacity = kv_capacity_tokens
        self._counters: dict[tuple[str, Labels], float] = {}
        self._histograms: dict[tuple[str, Labels], _Histogram] = {}
        self._buckets: dict[str, tuple[float, ...]] = {
            "tgi_request_input_length": token_buckets(max_input_tokens),
            "tgi_request_max_new_tokens": token_buckets(max_total_tokens),
            "tgi_request_generated_tokens": token_buckets(max_total_tokens),
            "tgi_batch_next_size": BATCH_SIZE_BUCKETS,
        }
        self._started: set[str] = set()

    # ------------------------------------------------------------------ recording

    def _inc(self, name: str, labels: Mapping[str, str] | None = None, by: float = 1.0) -> None:
        key = (name, tuple(sorted((labels or {}).items())))
        self._counters[key] = self._counters.get(key, 0.0) + by

    def _observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        key = (name, tuple(sorted((labels or {}).items())))
        if key not in self._histograms:
            self._histograms[key] = _Histogram(self._buckets.get(name, DURATION_BUCKETS))
        self._histograms[key].observe(value)

    def record_request(self) -> None:
        """A generation request arrived (any route), before its permit or validation."""
        self._inc("tgi_request_count")

    def record_rejected(self, err: str) -> None:
        """A request refused before it entered the engine: ``overloaded`` (429), ``validation``."""
        self._inc("tgi_request_failure", {"err": err})

    def record_admitted(self, prompt_tokens: int, max_new_tokens: int, validation_s: float) -> None:
        """A request passed validation (its permit taken): its lengths and validation time."""
        self._observe("tgi_request_input_length", float(prompt_tokens))
        self._observe("tgi_request_max_new_tokens", float(max_new_tokens))
        self._observe("tgi_request_validation_duration", validation_s)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """A request left the engine: durations on success, ``dropped`` when its client left."""
        self._started.discard(stats.request_id)
        if stats.finish_reason == "abort":
            self._inc("tgi_request_failure", {"err": "dropped"})
            return
        self._inc("tgi_request_success")
        self._observe("tgi_request_duration", stats.e2e_s)
        self._observe("tgi_request_queue_duration", stats.queue_s)
        self._observe("tgi_request_inference_duration", stats.inference_s)
        self._observe(
            "tgi_request_mean_time_per_token_duration", stats.inference_s / max(stats.generation_tokens, 1)
        )
        self._observe("tgi_request_generated_tokens", float(stats.generation_tokens))

    def record_step(self, result: StepResult, plan: StepPlan | None = None) -> None:
        """One engine step: count it and time it, by ``method`` (prefill when it prefilled); its
        finished requests. Without ``plan`` only the finished requests are recorded."""
        if plan is not None:
            method = {"method": "prefill" if plan.num_prefill_tokens > 0 else "decode"}
            self._inc("tgi_batch_inference_count", method)
            self._inc("tgi_batch_inference_success", method)
            self._observe("tgi_batch_forward_duration", plan.duration_s, method)
            self._observe("tgi_batch_inference_duration", _cycle_s(plan), method)
            new = [rid for rid in plan.num_scheduled_tokens if rid not in self._started]
            if new:
                self._started.update(new)
                self._observe("tgi_batch_next_size", float(len(new)))
        for finished in result.finished:
            self.record_finished(finished)

    def sync_counters(self) -> None:
        """Nothing to sync: every counter is recorded as it happens."""

    # ------------------------------------------------------------------ rendering

    def _gauges(self) -> list[tuple[str, float]]:
        return [
            ("tgi_batch_current_max_tokens", float(self._engine.reserved_tokens)),
            ("tgi_batch_current_size", float(self._engine.num_running)),
            ("tgi_batch_max_total_tokens", float(self._capacity)),
            ("tgi_queue_size", float(self._engine.num_waiting)),
        ]

    def exposition(self) -> bytes:
        """The ``/metrics`` body: counters, gauges, histograms, each family sorted by name."""
        lines: list[str] = []
        for name in sorted({n for n, _ in self._counters}):
            lines.append(f"# TYPE {name} counter")
            for (n, labels), value in sorted(self._counters.items()):
                if n == name:
                    lines.append(f"{name}{_labels(labels)} {rust_number(value)}")
        for name, value in self._gauges():
            lines += [f"# TYPE {name} gauge", f"{name} {rust_number(value)}"]
        for name in sorted({n for n, _ in self._histograms}):
            lines.append(f"# TYPE {name} histogram")
            for (n, labels), h in sorted(self._histograms.items(), key=lambda kv: kv[0]):
                if n == name:
                    lines += _histogram_lines(name, labels, h)
        return ("\n".join(lines) + "\n").encode()


def _cycle_s(plan: StepPlan) -> float:
    """The step as TGI's router times it (``tgi_batch_inference_duration``): from its scheduling
    to now, on the running loop's clock (the one ``plan.started_at`` was read on), never less than
    the forward pass. On a busy host the loop wakes late and token dispatch takes time: that is
    the emulator's counterpart of the router's own work, which every next token waits for too.
    Outside a running loop (a direct unit test), the forward time."""
    try:
        now = asyncio.get_running_loop().time()
    except RuntimeError:
        return plan.duration_s
    elapsed = now - plan.started_at
    return elapsed if plan.started_at > 0.0 and plan.duration_s <= elapsed < 60.0 else plan.duration_s


def _labels(labels: Sequence[tuple[str, str]]) -> str:
    return "" if not labels else "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def _histogram_lines(name: str, labels: Labels, h: _Histogram) -> list[str]:
    lines = []
    cumulative = 0
    for bound, count in zip(h.bounds, h.counts or [0] * len(h.bounds), strict=True):
        cumulative += count
        lines.append(f"{name}_bucket{_labels((*labels, ('le', rust_number(bound))))} {cumulative}")
    lines.append(f"{name}_bucket{_labels((*labels, ('le', '+Inf')))} {h.count}")
    lines.append(f"{name}_sum{_labels(labels)} {rust_number(h.sum)}")
    lines.append(f"{name}_count{_labels(labels)} {h.count}")
    return lines


# ---------------------------------------------------------------------------------------------
# /info and the native API's bodies
# ---------------------------------------------------------------------------------------------


def info_body(
    *, model_id: str, max_concurrent_requests: int, max_input_tokens: int, max_total_tokens: int
) -> dict[str, Any]:
    """``GET /info``: TGI's ``Info`` struct, in its field order (v2.3+: no batch limits in it)."""
    return {
        "model_id": model_id,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": max_concurrent_requests,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_input_tokens": max_input_tokens,
        "max_total_tokens": max_total_tokens,
        "validation_workers": 2,
        "max_client_batch_size": 4,
        "router": "text-generation-router",
        "version": TGI_VERSION,
        "sha": None,
        "docker_label": None,
    }


def models_body(model_id: str) -> dict[str, Any]:
    """``GET /v1/models``: TGI's ``ModelsInfo`` (``openai_get_model_info``): one ``ModelInfo`` of
    ``id``, ``object``, ``created`` (always 0) and ``owned_by`` (the model id). No context length:
    a router reads that from ``/info``'s ``max_total_tokens``."""
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}],
    }


class TgiError(Exception):
    """An error TGI answers with ``{"error", "error_type"}`` and ``status``."""

    def __init__(self, message: str, *, error_type: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type
        self.status = status

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


def overloaded() -> TgiError:
    return TgiError(OVERLOADED_BODY["error"], error_type=OVERLOADED_BODY["error_type"], status=429)


def validation_error(message: str) -> TgiError:
    return TgiError(message, error_type="validation", status=422)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated ``POST /generate`` or ``/generate_stream`` body."""

    inputs: str
    prompt_tokens: int
    max_new_tokens: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    seed: int | None


def parse_generate(
    body: Any, *, prompt_tokens: int, max_input_tokens: int, max_total_tokens: int
) -> GenerateRequest:
    """Validate a native body as TGI's ``validation.rs`` does (raises ``TgiError`` 422).

    ``prompt_tokens`` is the caller's count of ``inputs``. Order as TGI: empty input, positive
    ``max_new_tokens``, input length, then input + ``max_new_tokens`` against the total.
    """
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), str):
        raise TgiError(
            "Failed to deserialize the JSON body into the target type: missing field `inputs`",
            error_type="validation",
            status=422,
        )
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise validation_error("`parameters` must be an object")
    inputs: str = body["inputs"]
    if not inputs:
        raise validation_error("`inputs` cannot be empty")
    raw_max = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    max_new = DEFAULT_MAX_NEW_TOKENS if raw_max is None else raw_max
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new <= 0:
        raise validation_error("`max_new_tokens` must be strictly positive")
    if prompt_tokens > max_input_tokens:
        raise validation_error(
            f"`inputs` must have less than {max_input_tokens} tokens. Given: {prompt_tokens}"
        )
    if prompt_tokens + max_new > max_total_tokens:
        raise validation_error(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
            f"Given: {prompt_tokens} `inputs` tokens and {max_new} `max_new_tokens`"
        )
    seed = params.get("seed")
    return GenerateRequest(
        inputs=inputs,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new,
        details=bool(params.get("details", False)),
        decoder_input_details=bool(params.get("decoder_input_details", False)),
        return_full_text=bool(params.get("return_full_text") or False),
        seed=seed if isinstance(seed, int) else None,
    )


def finish_reason(engine_reason: str | None) -> str:
    """TGI's ``FinishReason``: ``length``, ``eos_token`` (the model stopped), ``stop_sequence``."""
    return "length" if engine_reason == "length" else "eos_token"


def token(token_id: int, text: str) -> dict[str, Any]:
    """TGI's ``Token``: ``{"id", "text", "logprob", "special"}`` (a fake but stable logprob)."""
    return {"id": token_id, "text": text, "logprob": -round((token_id % 1000) / 1000.0, 4), "special": False}


def stream_event(
    index: int,
    tok: Mapping[str, Any],
    *,
    generated_text: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``/generate_stream`` event: ``StreamResponse`` in field order (``top_tokens`` is left
    out when empty, as TGI's serde does); only the last one carries text and details."""
    return {
        "index": index,
        "token": dict(tok),
        "generated_text": generated_text,
        "details": None if details is None else dict(details),
    }


def stream_details(reason: str, generated_tokens: int, seed: int | None, input_length: int) -> dict[str, Any]:
    """``StreamDetails`` (only with ``parameters.details``), in TGI's field order."""
    return {
        "finish_reason": reason,
        "generated_tokens": generated_tokens,
        "seed": seed,
        "input_length": input_length,
    }


def generate_body(
    text: str, *, details: bool, reason: str, tokens: Sequence[Mapping[str, Any]], seed: int | None
) -> dict[str, Any]:
    """``POST /generate``'s ``GenerateResponse``: ``details`` only when asked for."""
    body: dict[str, Any] = {"generated_text": text}
    if details:
        body["details"] = {
            "finish_reason": reason,
            "generated_tokens": len(tokens),
            "seed": seed,
            "prefill": [],
            "tokens": [dict(t) for t in tokens],
        }
    return body
