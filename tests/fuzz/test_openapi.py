"""The OpenAPI document (``gateway.http.openapi``) is valid, complete, and says what the parser does.

* it validates against the OpenAPI 3.1 meta-schema (schemathesis' validator; a broken document
  is shown to fail it, so the check is not vacuous);
* every route the gateway serves is described, and every described route is served (TGI's
  native routes excepted until ``gateway.app`` routes them);
* both directions of "the schema is the parser": request bodies schemathesis generates from the
  document as valid are accepted by ``parse_request`` / ``parse_native``, and bodies it generates
  as invalid are refused with a 400. The request schemas are generated from the parser's pydantic
  models, so this is what catches a hand edit, or a check added in code but not in the model.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from jsonschema_rs import ValidationError
from schemathesis import GenerationMode
from schemathesis.core.parameters import ParameterLocation

from gateway.api.openai import Endpoint, ParsedRequest, parse_native, parse_request
from gateway.http.errors import InvalidRequest
from gateway.http.openapi import openapi_spec
from tests.fuzz.live import ensure_openapi
from tests.unit.gateway.fakes import gateway_settings, make_app

#: TGI's native routes: described even where ``gateway.app`` does not route them (yet).
NATIVE_PATHS = {("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/")}
BOUNDED = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
BODY_OPERATIONS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/generate_stream": "generate_stream",
    "/": "generate",
}


def test_document_is_valid_openapi_3_1() -> None:
    spec = openapi_spec()
    schemathesis.openapi.from_dict(spec).validate()

    assert spec["openapi"].startswith("3.1")
    broken = {**spec, "paths": {"/x": {"get": {"responses": {"200": {"content": 5}}}}}}
    with pytest.raises(ValidationError):
        schemathesis.openapi.from_dict(broken).validate()


def test_every_route_is_described_and_every_description_routed() -> None:
    app, _, _ = make_app(gateway_settings({"r1": "http://127.0.0.1:9"}))  # built, never started
    ensure_openapi(app)
    routed = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    described = {(method.upper(), path) for path, item in openapi_spec()["paths"].items() for method in item}

    assert routed <= described, routed - described
    assert described - routed <= NATIVE_PATHS


def test_errors_and_security_are_described() -> None:
    spec = openapi_spec()
    chat = spec["paths"]["/v1/chat/completions"]["post"]

    assert set(spec["components"]["schemas"]["Error"]["properties"]["error"]["required"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert {"400", "401", "404", "413", "429", "503"} <= set(chat["responses"])
    assert {"Retry-After", "retry-after-ms", "x-ratelimit-remaining-tokens"} <= set(
        chat["responses"]["429"]["headers"]
    )
    assert chat["security"] == [{"bearerAuth": []}]
    models = spec["paths"]["/v1/models"]["get"]
    assert (models["security"], "401" in models["responses"]) == ([{"bearerAuth": []}], True)
    assert spec["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def parse(path: str, raw: bytes) -> ParsedRequest:
    endpoint = BODY_OPERATIONS[path]
    if endpoint in ("generate", "generate_stream"):
        return parse_native(endpoint, raw, "fuzz-model")
    return parse_request(endpoint, raw)


def has_whole_float(value: object) -> bool:
    """True when ``value`` holds a float without fraction (JSON Schema's ``integer`` admits ``1.0``;
    Sluice, like OpenAI, refuses it: the one documented difference)."""
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(has_whole_float(item) for item in value.values())
    if isinstance(value, list):
        return any(has_whole_float(item) for item in value)
    return False


@pytest.mark.parametrize("path", list(BODY_OPERATIONS))
def test_bodies_valid_per_the_document_are_accepted(path: str) -> None:
    operation = schemathesis.openapi.from_dict(openapi_spec())[path]["POST"]
    accepted = 0

    @BOUNDED
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case: Any) -> None:
        nonlocal accepted
        if has_whole_float(case.body):
            return
        parsed = parse(path, json.dumps(case.body).encode())
        assert parsed.body == case.body
        accepted += 1

    run()
    assert accepted > 0


@pytest.mark.parametrize("path", list(BODY_OPERATIONS))
def test_bodies_invalid_per_the_document_are_refused(path: str) -> None:
    operation = schemathesis.openapi.from_dict(openapi_spec())[path]["POST"]
    refused = 0

    @BOUNDED
    @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def run(case: Any) -> None:
        nonlocal refused
        if case.meta is None or not case.meta.is_negative_at(ParameterLocation.BODY):
            return  # a mutated header, not the body
        raw = json.dumps(case.body).encode() if not isinstance(case.body, bytes) else case.body
        with pytest.raises(InvalidRequest):
            parse(path, raw)
        refused += 1

    run()
    assert refused > 0
