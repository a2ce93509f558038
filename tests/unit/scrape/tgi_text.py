"""A TGI ``/metrics`` body built from the reference's metric list, for the TGI dialect tests.

No real TGI scrape exists in public (``shared/reference/backend-metrics.md`` §6: the TGI repo, its
docs and the public issues only have hand-written mocks, several with wrong names). So this text
is BUILT, not captured: every name, type and label is taken from the reference's TGI table
(§2.1, read in TGI's router source at ``db931fc``): counters without ``_total``, no model label,
``method`` on the batch families, ``err`` on ``tgi_request_failure``, the duration buckets
``0.0001 x 1.5^k`` (k = 1..35) and the token buckets ``max / 100 x (1..100)``. Only the values
are the test's choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: TGI's duration buckets (router ``server.rs``): 35 geometric buckets from 0.00015 s.
DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))


def token_buckets(maximum: int) -> tuple[float, ...]:
    """TGI's token-count buckets: ``maximum / 100`` times 1..100."""
    return tuple(maximum / 100 * i for i in range(1, 101))


@dataclass(frozen=True)
class Observed:
    """Observations of one histogram series: all land at ``value`` (so the mean is ``value``)."""

    count: int
    value: float


@dataclass(frozen=True)
class TgiState:
    """The values a built scrape carries (cumulative since the router started)."""

    queue_size: int = 3
    batch_size: int = 8
    reserved_tokens: int = 12_000
    max_total_tokens_capacity: int = 60_000
    requests: int = 100
    success: int = 80
    failures: Mapping[str, int] = field(default_factory=lambda: {"overloaded": 6, "dropped": 2})
    decode: Observed = Observed(900, 0.012)
    prefill: Observed = Observed(100, 0.050)
    input_tokens: Observed = Observed(100, 500.0)
    generated_tokens: Observed = Observed(80, 200.0)
    queue_duration: Observed = Observed(90, 0.2)
    request_duration: Observed = Observed(80, 3.0)
    #: ``tgi_batch_next_size``: prefill batches by the requests each started (absent when empty).
    next_sizes: Mapping[int, int] = field(default_factory=dict)


def _number(value: float) -> str:
    # Rust prints an integral f64 without a fraction; shortest round-trip otherwise, like repr.
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(labels: Mapping[str, str]) -> str:
    return "" if not labels else "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _histogram(
    lines: list[str],
    name: str,
    series: Sequence[tuple[Mapping[str, str], Observed]],
    buckets: Sequence[float],
) -> None:
    lines.append(f"# TYPE {name} histogram")
    for labels, obs in series:
        for le in buckets:
            below = obs.count if obs.value <= le else 0
            lines.append(f"{name}_bucket{_labels({**labels, 'le': _number(le)})} {below}")
        lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {obs.count}")
        lines.append(f"{name}_sum{_labels(labels)} {_number(obs.count * obs.value)}")
        lines.append(f"{name}_count{_labels(labels)} {obs.count}")


def tgi_exposition(s: TgiState, *, max_input_tokens: int = 4095, max_total_tokens: int = 4096) -> str:
    """The text of one TGI scrape carrying ``s`` (see the module docstring for where names come from)."""
    lines: list[str] = []
    for name, value in (
        ("tgi_queue_size", s.queue_size),
        ("tgi_batch_current_size", s.batch_size),
        ("tgi_batch_current_max_tokens", s.reserved_tokens),
        ("tgi_batch_max_total_tokens", s.max_total_tokens_capacity),
    ):
        lines += [f"# TYPE {name} gauge", f"{name} {value}"]
    lines += ["# TYPE tgi_request_count counter", f"tgi_request_count {s.requests}"]
    lines += ["# TYPE tgi_request_success counter", f"tgi_request_success {s.success}"]
    lines.append("# TYPE tgi_request_failure counter")
    lines += [f'tgi_request_failure{{err="{err}"}} {n}' for err, n in s.failures.items()]
    steps = (("prefill", s.prefill), ("decode", s.decode))
    for family in ("tgi_batch_inference_count", "tgi_batch_inference_success"):
        lines.append(f"# TYPE {family} counter")
        lines += [f'{family}{{method="{m}"}} {obs.count}' for m, obs in steps]
    for family in ("tgi_batch_forward_duration", "tgi_batch_inference_duration"):
        _histogram(lines, family, [({"method": m}, obs) for m, obs in steps], DURATION_BUCKETS)
    _histogram(lines, "tgi_request_queue_duration", [({}, s.queue_duration)], DURATION_BUCKETS)
    _histogram(lines, "tgi_request_duration", [({}, s.request_duration)], DURATION_BUCKETS)
    _histogram(lines, "tgi_request_input_length", [({}, s.input_tokens)], token_buckets(max_input_tokens))
    _histogram(
        lines, "tgi_request_generated_tokens", [({}, s.generated_tokens)], token_buckets(max_total_tokens)
    )
    if s.next_sizes:
        # Buckets 1..1024 step 1 (``BATCH_SIZE_BUCKETS``): one bucket per batch size.
        lines.append("# TYPE tgi_batch_next_size histogram")
        for le in range(1, 1025):
            below = sum(n for size, n in s.next_sizes.items() if size <= le)
            lines.append(f'tgi_batch_next_size_bucket{{le="{le}"}} {below}')
        total = sum(s.next_sizes.values())
        lines.append(f'tgi_batch_next_size_bucket{{le="+Inf"}} {total}')
        lines.append(f"tgi_batch_next_size_sum {sum(size * n for size, n in s.next_sizes.items())}")
        lines.append(f"tgi_batch_next_size_count {total}")
    return "\n".join(lines) + "\n"
