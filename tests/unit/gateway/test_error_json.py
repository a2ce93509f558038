"""``GatewayError.body_bytes`` (the serialised error body every error response and SSE error event
carries) is byte for byte what ``json.dumps(err.body()).encode()`` writes, for every kind of
error and any message text: quotes, backslashes, control characters, non-ASCII, lone surrogates.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.retry_after import RefusalReason, RetryAfter
from gateway.http.errors import (
    AdmissionRejected,
    BodyTooLarge,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    Refused,
    Unauthenticated,
    error_response,
    sse_error_event,
)

#: Every code point, surrogates included.
TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
RETRY = RetryAfter(delay_s=0.734, seconds=1, milliseconds=734, base_s=0.5)


def errors_saying(message: str, param: str | None) -> list[GatewayError]:
    return [
        AdmissionRejected(message, reason="deadline_exceeded", retry_after=RETRY),
        AdmissionRejected(message, reason="slo_unattainable", retry_after=None),
        InvalidRequest(message, param=param),
        InvalidRequest(message, param=param, code=message),
        BodyTooLarge(message),
        MethodNotAllowed(message, allowed=frozenset({"GET"})),
        Refused(RefusalReason.NO_HEALTHY_REPLICA, message, retry_after=RETRY),
        Refused(RefusalReason.PROMPT_TOO_LARGE, message, retry_after=None, param="messages"),
        Refused(RefusalReason.REPLICAS_SATURATED, message, retry_after=RETRY),
        Refused(RefusalReason.RATE_LIMITED, message, retry_after=None),
        Refused(RefusalReason.SHUTTING_DOWN, message, retry_after=RETRY),
        Unauthenticated(message, www_authenticate="Bearer", code="invalid_api_key"),
    ]


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(message=TEXT, param=st.none() | TEXT)
def test_body_bytes_is_what_json_dumps_writes(message: str, param: str | None) -> None:
    for err in errors_saying(message, param):
        expected = json.dumps(err.body()).encode()
        assert err.body_bytes() == expected
        assert error_response(err).body == expected
        assert sse_error_event(err) == b"data: " + expected + b"\n\n"


def test_a_429_body_names_its_reason() -> None:
    err = AdmissionRejected('late "by" 0.2 s', reason="deadline_exceeded", retry_after=RETRY)
    assert json.loads(err.body_bytes()) == {
        "error": {
            "message": 'late "by" 0.2 s',
            "type": "deadline_exceeded",
            "param": None,
            "code": "deadline_exceeded",
        }
    }
