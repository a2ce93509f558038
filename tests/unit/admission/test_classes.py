"""Choosing a request's class from the header and the tenant, and the client's own deadline."""

from __future__ import annotations

import pytest

from gateway.admission import AdmissionSettings, ClassSource, InvalidHeader, choose_class, client_deadline_s
from tests.unit.admission.fleet import request

SETTINGS = AdmissionSettings()


@pytest.mark.parametrize(
    ("header", "tenant_default", "allowed", "name", "source", "ignored"),
    [
        pytest.param(None, None, None, "interactive", ClassSource.DEFAULT, None, id="nothing-default"),
        pytest.param("batch", None, None, "batch", ClassSource.HEADER, None, id="header-any-allowed"),
        pytest.param(" batch ", None, None, "batch", ClassSource.HEADER, None, id="header-trimmed"),
        pytest.param(None, "batch", None, "batch", ClassSource.TENANT, None, id="tenant-default"),
        pytest.param(
            "interactive",
            "batch",
            {"batch"},
            "batch",
            ClassSource.TENANT,
            "interactive",
            id="not-allowed-falls-back",
        ),
        pytest.param(
            "interactive",
            "batch",
            {"batch", "interactive"},
            "interactive",
            ClassSource.HEADER,
            None,
            id="allowed",
        ),
        pytest.param(
            "gold", None, None, "interactive", ClassSource.DEFAULT, "gold", id="unknown-class-ignored"
        ),
        pytest.param(
            None, "gold", None, "interactive", ClassSource.DEFAULT, None, id="unknown-tenant-default-ignored"
        ),
    ],
)
def test_choose_class(header, tenant_default, allowed, name: str, source: ClassSource, ignored) -> None:
    choice = choose_class(SETTINGS, header, tenant_default=tenant_default, allowed=allowed)
    assert (choice.name, choice.source, choice.ignored_header) == (name, source, ignored)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(None, None, id="absent"),
        pytest.param("250", 1000.25, id="integer-ms"),
        pytest.param("1.5", 1000.0015, id="fractional-ms"),
        pytest.param(" 0 ", 1000.0, id="zero"),
    ],
)
def test_client_deadline(value: str | None, expected: float | None) -> None:
    got = client_deadline_s(1000.0, value)
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("value", ["-5", "soon", "1e3", "", "nan", "inf", "12ms"])
def test_unreadable_deadline_header_is_an_error(value: str) -> None:
    with pytest.raises(InvalidHeader) as info:
        client_deadline_s(1000.0, value, header="x-sluice-deadline-ms")
    assert info.value.message == (
        f"invalid x-sluice-deadline-ms header {value!r}: expected a non-negative number of milliseconds"
    )


def test_a_long_unreadable_deadline_header_is_quoted_clipped() -> None:
    with pytest.raises(InvalidHeader) as info:
        client_deadline_s(1000.0, "x" * 8000, header="x-sluice-deadline-ms")
    quoted = repr("x" * 64 + "…")
    assert info.value.message.startswith(f"invalid x-sluice-deadline-ms header {quoted}: expected")


@pytest.mark.parametrize(
    ("deadline", "expected", "client_bound"),
    [
        pytest.param(None, 1002.0, False, id="class-target"),
        pytest.param(1000.5, 1000.5, True, id="client-tightens"),
        pytest.param(1010.0, 1002.0, False, id="client-cannot-loosen"),
    ],
)
def test_first_token_deadline(deadline: float | None, expected: float, client_bound: bool) -> None:
    cls = SETTINGS.classes["interactive"]
    r = request(arrival=1000.0, deadline=deadline)
    assert r.first_token_deadline_s(cls) == pytest.approx(expected)
    assert r.client_bound(cls) == client_bound
    assert r.queue_deadline_s(cls) == pytest.approx(min(expected, 1000.0 + cls.max_queue_wait_s))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        pytest.param({"prompt_tokens": 0}, "prompt_tokens must be >= 1, got 0", id="empty-prompt"),
        pytest.param({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0", id="zero-cap"),
        pytest.param(
            {"expected_output_tokens": float("nan")}, "expected_output_tokens must be finite", id="nan-output"
        ),
    ],
)
def test_request_rejects_impossible_sizes(kw: dict[str, object], message: str) -> None:
    from gateway.admission import AdmissionRequest

    base: dict[str, object] = {
        "request_id": "r",
        "request_class": "interactive",
        "prompt_tokens": 10,
        "max_tokens": 10,
        "expected_output_tokens": 5.0,
        "arrival_s": 0.0,
    }
    with pytest.raises(ValueError, match=message):
        AdmissionRequest(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "arrivals"),
    [
        pytest.param(["50", "50", " 50", "50"], [1000.0, 1000.5, 2000.25, 3.0], id="repeated"),
        pytest.param(["250.5", "7", "250.5", "7"], [10.0, 10.0, 11.0, 12.0], id="interleaved"),
    ],
)
def test_deadlines_read_again_are_the_same(values: list[str], arrivals: list[float]) -> None:
    """A header value read before (kept as seconds) gives what parsing it anew gives."""
    for value, arrival in zip(values, arrivals, strict=True):
        assert client_deadline_s(arrival, value) == arrival + float(value.strip()) / 1000.0


@pytest.mark.parametrize("value", ["-1", "soon", "1e3"])
def test_invalid_deadlines_stay_invalid_when_repeated(value: str) -> None:
    for _ in range(3):
        with pytest.raises(InvalidHeader):
            client_deadline_s(1000.0, value)
