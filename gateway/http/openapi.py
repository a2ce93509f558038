"""An OpenAPI 3.1 description of Sluice's own HTTP surface, served at ``GET /openapi.json``.

It covers the proxied routes (OpenAI and TGI's native ones), ``/v1/models``, the probes, the admin
routes and itself, with the OpenAI-style error body on every status Sluice answers with and the
429's headers. Request schemas are generated from the pydantic models the parser validates with,
so the document cannot drift from what Sluice accepts; bodies allow further fields (passed through
untouched). JSON Schema's ``integer`` admits ``1.0``, which Sluice refuses with a 400, as OpenAI
does. ``openapi_spec()`` returns a fresh dict (callers may mutate it); ``install_openapi(app)``
serves it without credentials (it holds no secrets), serialised once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.admission.config import HeaderSettings
from gateway.api.openai import MODEL_HEADER, _ChatBody, _CompletionBody
from gateway.api.tgi import _GenerateBody
from gateway.observability.logs import REQUEST_ID_HEADER
from gateway.version import package_version

__all__ = ["OPENAPI_PATH", "REQUEST_SCHEMAS", "install_openapi", "openapi_spec"]

#: Where ``install_openapi`` serves the document.
OPENAPI_PATH: Final = "/openapi.json"
#: The version of the OpenAPI specification the document follows.
OPENAPI_VERSION: Final = "3.1.0"

#: Component name of each pydantic model the request bodies are generated from.
REQUEST_SCHEMAS: Final[Mapping[type[BaseModel], str]] = {
    _ChatBody: "ChatCompletionRequest",
    _CompletionBody: "CompletionRequest",
    _GenerateBody: "GenerateRequest",
}
#: Public names of the nested models pydantic puts in ``$defs`` (their class names otherwise).
_NESTED_NAMES: Final[Mapping[str, str]] = {
    "_StreamOptions": "StreamOptions",
    "_Parameters": "GenerateParameters",
}
_REF_PREFIX: Final = "#/components/schemas/"

_ERROR_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "description": "Every error Sluice answers with (OpenAI's shape).",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "Human-readable; never a traceback or key."},
                "type": {"type": "string", "examples": ["invalid_request_error", "rate_limit_exceeded"]},
                "param": {"type": ["string", "null"], "description": "The offending field or header."},
                "code": {
                    "type": ["string", "integer", "null"],
                    "description": "Sluice's own code (a string, or null); a replica's error relayed "
                    "unchanged may carry its HTTP status here instead (vLLM).",
                    "examples": ["model_not_found", "slo_unattainable"],
                },
            },
        }
    },
}

_ERRORS: Final[Mapping[int, str]] = {
    400: "Invalid request: not JSON, a missing field, a field of the wrong type or a non-finite number "
    "(``param`` names it), a malformed header, or a prompt over every replica's limits "
    "(``prompt_too_large``; ``context_length_exceeded`` when the prompt and ``max_tokens`` exceed "
    "the context, whether Sluice or the replica finds it), or a body nesting too deep or holding too "
    "many values (``request_too_complex``).",
    401: "Missing, malformed or unknown API key (or admin token); carries ``WWW-Authenticate``.",
    404: "Unknown route, or no replica serves the model (``model_not_found``).",
    405: "Wrong method for this path; carries ``Allow``.",
    409: "A key change the key store cannot make (``keys_not_writable``, ``key_not_revocable``).",
    408: "The body did not arrive within ``server.client_read_timeout_s`` (``request_timeout``); "
    "the connection is closed.",
    413: "Body over ``server.max_body_bytes`` (``request_too_large``).",
    415: "Body not sent as ``Content-Type: application/json`` (``unsupported_media_type``).",
    429: "The tenant's budget is spent (``rate_limit_exceeded``) or admission refused the request "
    "for load (``overloaded``, ``slo_unattainable``, ``deadline_exceeded``).",
    502: "The replica failed: refused the connection, timed out, died mid-answer or answered 5xx.",
    503: "No healthy replica serves the model, or the shared budget store is down (``fail_closed``).",
}


def _header(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "schema": schema or {"type": "string"}}


_REQUEST_ID_RESPONSE_HEADER: Final = _header(
    "The request's id: the client's own ``x-request-id`` when it is 1-128 characters of "
    "``[A-Za-z0-9._:/+=@-]``, else one Sluice generated (32 hex digits)."
)
_RETRY_HEADERS: Final[dict[str, Any]] = {
    "Retry-After": _header("Whole seconds to wait (RFC 9110 delay-seconds), at least 1.", {"type": "string"}),
    "retry-after-ms": _header("The same delay in milliseconds.", {"type": "string"}),
    "x-should-retry": _header("``false`` when retrying cannot help (the ``openai`` SDKs obey it)."),
}
_RATE_LIMIT_HEADERS: Final[dict[str, Any]] = {
    **{
        f"x-ratelimit-{part}-{kind}": _header(f"OpenAI's {part} of the tenant's {kind} budget.")
        for part in ("limit", "remaining", "reset")
        for kind in ("requests", "tokens")
    },
    "RateLimit-Policy": _header(
        "The tenant's budgets (draft-ietf-httpapi-ratelimit-headers-11), with limits.ietf_headers."
    ),
    "RateLimit": _header("What is left of each budget (the IETF draft's field), with limits.ietf_headers."),
}


def _error_response(status: int) -> dict[str, Any]:
    headers: dict[str, Any] = {REQUEST_ID_HEADER: _REQUEST_ID_RESPONSE_HEADER}
    if status == 401:
        headers["WWW-Authenticate"] = _header("The RFC 6750 bearer challenge.")
    if status == 405:
        headers["Allow"] = _header("The methods this path serves.")
    if status in (429, 503):
        headers.update(_RETRY_HEADERS)
    if status == 429:
        headers.update(_RATE_LIMIT_HEADERS)
    return {
        "description": _ERRORS[status],
        "headers": headers,
        "content": {"application/json": {"schema": {"$ref": _REF_PREFIX + "Error"}}},
    }


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {REQUEST_ID_HEADER: _REQUEST_ID_RESPONSE_HEADER},
        "content": content,
    }


_JSON_OBJECT: Final[dict[str, Any]] = {"application/json": {"schema": {"type": "object"}}}
#: One server-sent event (a tool like schemathesis checks each event of a stream against it).
_EVENT_STREAM: Final[dict[str, Any]] = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {"type": "string", "description": "One JSON chunk; OpenAI streams end with [DONE]."},
                "event": {"type": "string"},
            },
        }
    }
}


def _request_id_parameter() -> dict[str, Any]:
    return {
        "name": REQUEST_ID_HEADER,
        "in": "header",
        "required": False,
        "description": "The client's request id; echoed only when 1-128 characters of "
        "``[A-Za-z0-9._:/+=@-]``, otherwise replaced by a generated one (never echoed).",
        "schema": {"type": "string"},
    }


def _admission_parameters() -> list[dict[str, Any]]:
    headers = HeaderSettings()
    return [
        {
            "name": headers.request_class,
            "in": "header",
            "required": False,
            "description": "The request's admission class (``interactive``, ``batch`` or a configured "
            "one); honoured only for classes the tenant may use, ignored otherwise.",
            "schema": {"type": "string"},
        },
        {
            "name": headers.deadline_ms,
            "in": "header",
            "required": False,
            "description": "The client's own first-token deadline in milliseconds from arrival; "
            "anything but a non-negative decimal number is a 400.",
            "schema": {"type": "string", "pattern": r"^[0-9]{1,12}(\.[0-9]{1,6})?$"},
        },
    ]


def _proxied(summary: str, body_schema: str, *, native: bool) -> dict[str, Any]:
    parameters = [_request_id_parameter(), *_admission_parameters()]
    if native:
        parameters.append(
            {
                "name": MODEL_HEADER,
                "in": "header",
                "required": False,
                "description": "The model, when the TGI replicas serve several (the body names none).",
                "schema": {"type": "string"},
            }
        )
    responses: dict[str, Any] = {
        "200": _ok(
            "The replica's answer, relayed: one JSON object, or a stream of server-sent events.",
            {**_JSON_OBJECT, **_EVENT_STREAM},
        )
    }
    responses.update({str(status): _error_response(status) for status in _ERRORS})
    responses["4XX"] = {
        "description": "The replica's own refusal, relayed unchanged: vLLM's body has the OpenAI shape "
        '(``code`` an integer), TGI\'s is ``{"error": str, "error_type": str}`` (422 for validation).',
        "headers": {REQUEST_ID_HEADER: _REQUEST_ID_RESPONSE_HEADER},
        "content": _JSON_OBJECT,
    }
    return {
        "post": {
            "summary": summary,
            "security": [{"bearerAuth": []}],
            "parameters": parameters,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF_PREFIX + body_schema}}},
            },
            "responses": responses,
        }
    }


def _get(
    summary: str,
    content: dict[str, Any],
    errors: tuple[int, ...] = (),
    *,
    admin: bool = False,
    keyed: bool = False,
    responses: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A GET route answering ``content`` (200) or the ``errors``; ``responses`` replaces both.
    ``keyed``: it takes a tenant's API key, as the proxied routes do."""
    if responses is None:
        responses = {"200": _ok(summary, content)}
        responses.update({str(status): _error_response(status) for status in errors})
    # Public routes need no credentials; admin ones take the admin token when one is set.
    security: list[dict[str, list[str]]] = [{"adminToken": []}, {}] if admin else []
    return {
        "get": {
            "summary": summary,
            "security": [{"bearerAuth": []}] if keyed else security,
            "parameters": [_request_id_parameter()],
            "responses": responses,
        }
    }


def _admin_operation(
    summary: str, status: int, errors: tuple[int, ...], params: tuple[str, ...]
) -> dict[str, Any]:
    """An admin operation answering JSON with ``status`` or the ``errors``, with path ``params``."""
    responses = {str(status): _ok(summary, _JSON_OBJECT)}
    responses.update({str(code): _error_response(code) for code in (401, 404, *errors)})
    path_params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in params
    ]
    return {
        "summary": summary,
        "security": [{"adminToken": []}, {}],
        "parameters": [_request_id_parameter(), *path_params],
        "responses": responses,
    }


def _tenant_paths() -> dict[str, Any]:
    """The tenants admin routes (``gateway.tenants.admin_api``, ``gateway.tenants.keys_api``)."""
    tenant, key = ("id",), ("id", "key_id")
    return {
        "/sluice/v1/tenants": {
            "get": _admin_operation("Every tenant: limits, buckets now, in flight, recent 429s.", 200, (), ())
        },
        "/sluice/v1/tenants/{id}": {"get": _admin_operation("One tenant (as in the list).", 200, (), tenant)},
        "/sluice/v1/tenants/{id}/keys": {
            "get": _admin_operation(
                "The tenant's API keys by id and prefix, never a secret.", 200, (), tenant
            ),
            "post": _admin_operation(
                "Issue a key; the answer holds its secret, shown once.", 201, (409, 503), tenant
            ),
        },
        "/sluice/v1/tenants/{id}/keys/{key_id}": {
            "delete": _admin_operation("Revoke a key.", 200, (409, 503), key),
        },
    }


def _component_names() -> dict[str, str]:
    """Pydantic's ``$defs`` key (the class name) -> the public component name."""
    return {**{model.__name__: name for model, name in REQUEST_SCHEMAS.items()}, **_NESTED_NAMES}


def _rename(node: Any, names: Mapping[str, str]) -> Any:
    """``node`` with pydantic's ``$defs`` names replaced by the public component ``names``."""
    if isinstance(node, dict):
        renamed = {key: _rename(value, names) for key, value in node.items()}
        ref = renamed.get("$ref")
        if isinstance(ref, str) and ref.startswith(_REF_PREFIX):
            renamed["$ref"] = _REF_PREFIX + names.get(ref[len(_REF_PREFIX) :], ref[len(_REF_PREFIX) :])
        title = renamed.get("title")
        if isinstance(title, str) and title in names:
            renamed["title"] = names[title]
        return renamed
    if isinstance(node, list):
        return [_rename(item, names) for item in node]
    return node


def request_schemas() -> dict[str, Any]:
    """The request-body component schemas, generated from the parser's pydantic models (draft
    2020-12), keyed by public component name, nested models included."""
    _, top = models_json_schema(
        [(model, "validation") for model in REQUEST_SCHEMAS], ref_template=_REF_PREFIX + "{model}"
    )
    definitions: dict[str, Any] = top.get("$defs", {})
    names = _component_names()
    return {names.get(key, key): _rename(schema, names) for key, schema in definitions.items()}


def openapi_spec() -> dict[str, Any]:
    """The OpenAPI 3.1 document of Sluice's endpoints (a fresh ``dict`` each call)."""
    schemas = request_schemas()
    schemas["Error"] = json.loads(json.dumps(_ERROR_SCHEMA))
    paths: dict[str, Any] = {
        "/v1/chat/completions": _proxied(
            "OpenAI chat completion, admitted, limited and relayed to a replica.",
            "ChatCompletionRequest",
            native=False,
        ),
        "/v1/completions": _proxied(
            "OpenAI text completion, admitted, limited and relayed to a replica.",
            "CompletionRequest",
            native=False,
        ),
        "/generate": _proxied(
            "TGI native generation (one JSON answer, or a stream with ``stream: true``).",
            "GenerateRequest",
            native=True,
        ),
        "/generate_stream": _proxied(
            "TGI native generation, always streamed (server-sent events, one per token).",
            "GenerateRequest",
            native=True,
        ),
        "/": _proxied(
            "TGI's compat route (where the text_generation and huggingface_hub clients send): like "
            "``/generate``, with ``stream: true`` making it a stream.",
            "GenerateRequest",
            native=True,
        ),
        "/v1/models": _get("The union of the healthy replicas' models.", _JSON_OBJECT, (401,), keyed=True),
        "/healthz": _get("Liveness: 200 while the process serves HTTP.", _JSON_OBJECT),
        "/readyz": _get(
            'Readiness: 200 when a replica is healthy. The body is ``{"ready", "draining"}``; it '
            "lists the replicas only for a caller who may read the admin routes here (the admin token).",
            _JSON_OBJECT,
            responses={
                "200": _ok("At least one replica is healthy and the gateway is not draining.", _JSON_OBJECT),
                "503": _ok("No replica is healthy, or the gateway is draining.", _JSON_OBJECT),
            },
        ),
        "/metrics": _get(
            "Prometheus exposition of Sluice's own metrics.",
            {"text/plain": {"schema": {"type": "string"}}},
            (401, 404),
            admin=True,
        ),
        "/metrics/replicas": _get(
            "Prometheus HTTP service-discovery targets: one group per replica.",
            {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}},
            (401, 404),
            admin=True,
        ),
        OPENAPI_PATH: _get("This document.", _JSON_OBJECT),
        "/sluice/v1/replicas": _get(
            "Every replica's state, last snapshot and fitted step model.",
            _JSON_OBJECT,
            (401, 404),
            admin=True,
        ),
        **_tenant_paths(),
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Sluice",
            "version": package_version(),
            "description": "SLO-aware admission gateway for LLM inference: the OpenAI and TGI routes it "
            "proxies, and its own probes and admin routes.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A tenant's API key (required when tenants are configured).",
                },
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The admin token (admin.token_sha256), when one is configured.",
                },
            },
        },
    }


def install_openapi(app: web.Application) -> None:
    """Serve ``openapi_spec()`` at ``GET /openapi.json`` on ``app`` (before it starts)."""
    body = json.dumps(openapi_spec()).encode()

    async def handler(request: web.Request) -> web.Response:
        """The OpenAPI document, as JSON."""
        return web.Response(body=body, content_type="application/json")

    app.router.add_get(OPENAPI_PATH, handler)
