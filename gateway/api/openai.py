"""The request shapes Sluice reads: validation and the forwarded body.

OpenAI routes (``/v1/chat/completions``, ``/v1/completions``) and TGI's native ones
(``/generate``, ``/generate_stream``: their shapes are in ``gateway.api.tgi``) all become one
``ParsedRequest``, which admission, tenancy and the proxy read.

Only the fields the gateway acts on are checked (``model``, ``messages`` / ``prompt``,
``stream``, ``stream_options``, ``max_tokens``); everything else passes through untouched for the
replica to judge. Malformed input raises ``InvalidRequest`` (400) naming the offending field.
What the replica answers is read in ``gateway.api.responses``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from gateway.api.json_body import DEFAULT_LIMITS, JsonLimits, check_content_type, field_problem, load_object
from gateway.api.tgi import (
    TGI_ENGINE,
    appendable,
    generate_members,
    json_bytes_in_pieces,
    parse_generate,
    with_members,
)
from gateway.http.echo import clip
from gateway.http.errors import BodyTooLarge, ClientClosedRequest, InvalidRequest, ModelNotFound
from gateway.http.request_body import read_body

Endpoint = Literal["chat", "completions", "generate", "generate_stream"]
T = TypeVar("T")

#: Upstream path per endpoint (the gateway serves each on the same path).
ENDPOINT_PATHS: Mapping[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
    "generate_stream": "/generate_stream",
}
#: TGI's native endpoints: only replicas whose engine is TGI serve them.
NATIVE_ENDPOINTS: frozenset[Endpoint] = frozenset({"generate", "generate_stream"})
#: The gateway's completion routes and the endpoint each serves. TGI's compat route ``POST /``
#: (where the ``text_generation`` and ``huggingface_hub`` clients send) reads like ``/generate``,
#: with ``"stream": true`` making it a stream.
COMPLETION_ROUTES: Mapping[str, Endpoint] = {
    **{path: endpoint for endpoint, path in ENDPOINT_PATHS.items()},
    "/": "generate",
}
#: Header that picks the model of a native TGI request when the TGI replicas serve several.
MODEL_HEADER = "x-sluice-model"
#: Response header naming the ``max_tokens`` the gateway set on a request sent without one
#: (``with_max_tokens``; docs/tenants.md, "Hard caps").
MAX_TOKENS_SET_HEADER = "x-sluice-max-tokens-set"
#: vLLM's ``max_tokens`` for a ``/v1/completions`` body without one (or with ``null``): its
#: ``CompletionRequest`` default. A chat completion has none: the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Largest ``max_tokens`` accepted (2**53 - 1, the largest integer a float holds exactly): admission
#: computes with floats, and a larger cap than any context changes nothing. Larger is a 400.
MAX_TOKENS_LIMIT = 2**53 - 1


#: Largest ``n`` (choices per request) accepted, OpenAI's own limit: every choice is one more
#: sequence decoding on the replica and ``n`` times the output to reserve.
MAX_CHOICES = 128


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[StrictStr, Field(min_length=1)]
    stream: StrictBool | None = None
    stream_options: _StreamOptions | None = None
    # At least 1, as vLLM and OpenAI require (admission's requests need one output token).
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    # Choices per request, each a sequence of its own on the engine (OpenAI allows 1-128).
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None


class _ChatBody(_Common):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]


class _CompletionBody(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


_SCHEMAS: Mapping[Endpoint, type[_Common]] = {"chat": _ChatBody, "completions": _CompletionBody}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request.

    ``body`` is the decoded JSON object exactly as sent; ``raw`` the original bytes.
    ``include_usage`` is true when the client itself asked for the usage chunk of a stream.
    ``max_tokens`` is ``max_completion_tokens`` or ``max_tokens``; when absent, vLLM's default:
    ``COMPLETIONS_DEFAULT_MAX_TOKENS`` for a completion, ``None`` (the context left) for a chat.
    ``prompt_chars`` is the prompt's text length in characters (``prompt_size``);
    ``prompt_token_ids`` the prompt's length in tokens when it was sent as token ids, else ``None``.
    ``choices`` is the sequences the engine decodes for it, each up to ``max_tokens``: the body's
    ``n`` (1 when absent) times the prompts it sends (``prompt_sequences``: a completions list of
    strings or of token-id lists is one prompt per item, as vLLM decodes them).
    """

    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    body: Mapping[str, Any]
    raw: bytes
    prompt_chars: int = 0
    prompt_token_ids: int | None = None
    #: The engine its replica must run (``"tgi"`` for the native TGI routes); ``None``: any.
    engine: str | None = None
    #: Native TGI routes: the client itself asked for ``parameters.details``.
    details: bool = False
    choices: int = 1
    #: Several prompts (a completions list): the longest one's size, in ``prompt_token_ids``'s
    #: unit when they are token ids, else in characters; ``None`` for one prompt. Each prompt is a
    #: sequence of its own, so it alone must fit a replica's context.
    longest_prompt: int | None = None
    #: The ``max_tokens`` the gateway sets on the forwarded body (``with_max_tokens``); ``None``:
    #: the body's own (or none).
    max_tokens_set: int | None = None

    @property
    def native(self) -> bool:
        """True for TGI's native routes (``/generate``, ``/generate_stream``)."""
        return self.endpoint in NATIVE_ENDPOINTS


#: Bodies at least this long are decoded and validated on ``_PARSER``'s thread, so that the event
#: loop spends at most about 2 ms on one; below it the thread hop costs more than it saves
#: (docs/operations.md, "Floods and slow clients").
OFF_LOOP_BYTES = 64 * 1024
#: One thread for big bodies: decoding holds the GIL (``json``'s C scanner does not release it),
#: so more threads would not decode faster, only take the GIL from the event loop more often
#: and hold more half-decoded bodies in memory at once.
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-body")

#: The request's parsed body, cached by ``read_request``.
PARSED = web.RequestKey("parsed_request", ParsedRequest)
#: ``models(engine)``: the ids of the models that healthy replicas running ``engine`` serve
#: (the app installs the registry's; a native TGI request is routed to the one model they have).
ENGINE_MODELS: web.AppKey[Callable[[str], list[str]]] = web.AppKey("engine_models")


async def read_request(
    request: web.Request, endpoint: Endpoint, limit: int, limits: JsonLimits = DEFAULT_LIMITS
) -> ParsedRequest:
    """The request's body read (at most ``limit`` bytes) and parsed within ``limits``, once per
    request; a body of ``OFF_LOOP_BYTES`` or more is parsed on the one body-parsing thread.

    The tenancy middleware and the proxy both need it; the first caller pays, later callers get
    the same ``ParsedRequest``. Raises ``BodyTooLarge`` (413), ``ClientClosedRequest`` (a client
    gone mid-body) or ``InvalidRequest`` (415 for a body not sent as ``application/json``, else
    400).
    """
    cached: ParsedRequest | None = request.get(PARSED)
    if cached is not None:
        return cached
    raw = await _read_body(request, limit)
    check_content_type(request.headers.get("Content-Type"))
    parse: Callable[[], ParsedRequest]
    if endpoint in NATIVE_ENDPOINTS:
        models = request.config_dict.get(ENGINE_MODELS)
        served = models(TGI_ENGINE) if models is not None else []
        model = resolve_native_model(served, request.headers.get(MODEL_HEADER))
        parse = partial(parse_native, endpoint, raw, model, limits)
    else:
        parse = partial(parse_request, endpoint, raw, limits)
    if len(raw) >= OFF_LOOP_BYTES:
        parsed = await asyncio.get_running_loop().run_in_executor(_PARSER, parse)
    else:
        parsed = parse()
    request[PARSED] = parsed
    return parsed


async def off_loop(parsed: ParsedRequest, work: Callable[[], T]) -> T:
    """``work()``'s result: computed on the body-parsing thread when ``parsed``'s body is
    ``OFF_LOOP_BYTES`` or more (walking a body that large's decoded values would hold the event
    loop for milliseconds), else here. ``work`` may only read ``parsed``."""
    if len(parsed.raw) < OFF_LOOP_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_PARSER, work)


def resolve_native_model(served: list[str], asked: str | None) -> str:
    """The model a native TGI request goes to: the one the TGI replicas serve, or the one the
    ``x-sluice-model`` header names among them. Raises ``ModelNotFound`` (404) when none serves it
    and ``InvalidRequest`` (400) when several models leave the choice open."""
    if asked is not None:
        if asked in served:
            return asked
        raise ModelNotFound(f"no TGI replica serves the model `{clip(asked)}`", param=MODEL_HEADER)
    if len(served) == 1:
        return served[0]
    if not served:
        raise ModelNotFound("no healthy TGI replica: the native /generate routes need one")
    choices = ", ".join(sorted(served))
    raise InvalidRequest(
        f"the TGI replicas serve several models ({choices}); name one in the {MODEL_HEADER} header",
        param=MODEL_HEADER,
    )


def parse_native(
    endpoint: Endpoint, raw: bytes, model: str, limits: JsonLimits = DEFAULT_LIMITS
) -> ParsedRequest:
    """A ``/generate`` or ``/generate_stream`` body (within ``limits``) as a ``ParsedRequest`` for
    ``model``."""
    body, max_new_tokens, stream, details = parse_generate(
        raw, streaming_route=endpoint == "generate_stream", limits=limits
    )
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=False,
        max_tokens=max_new_tokens,
        body=body,
        raw=raw,
        prompt_chars=len(body["inputs"]),
        engine=TGI_ENGINE,
        details=details,
    )


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (the current setting) -> else 413.

    aiohttp enforces the limit the application was built with (``client_max_size``); this also
    enforces a smaller limit set by a later reload.
    """
    announced = request.content_length
    if announced is not None and announced > limit:
        raise BodyTooLarge(f"request body is {announced} bytes; the limit is {limit}")
    try:
        body = await read_body(request)
    except ConnectionResetError:
        raise ClientClosedRequest("the client closed the connection while sending the body") from None
    if len(body) > limit:
        raise BodyTooLarge(f"request body is {len(body)} bytes; the limit is {limit}")
    return body


def parse_request(endpoint: Endpoint, raw: bytes, limits: JsonLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """Decode (``gateway.api.json_body.load_object``: within ``limits``, finite numbers only) and
    validate one OpenAI request body; raises ``InvalidRequest`` with the field as ``param``.
    (Native TGI bodies go through ``parse_native``.)"""
    if endpoint in NATIVE_ENDPOINTS:
        raise ValueError(f"{endpoint} is a native TGI endpoint: use parse_native")
    body = load_object(raw, limits)
    fields = _plain_fields(endpoint, body)
    if fields is None:
        try:
            parsed = _SCHEMAS[endpoint].model_validate(body)
        except ValidationError as exc:
            raise _invalid_from(exc) from None
        options = parsed.stream_options
        max_tokens = parsed.max_completion_tokens
        fields = (
            parsed.model,
            bool(parsed.stream),
            bool(options is not None and options.include_usage),
            parsed.max_tokens if max_tokens is None else max_tokens,
            1 if parsed.n is None else parsed.n,
        )
    model, stream, include_usage, max_tokens, choices = fields
    if max_tokens is None and endpoint == "completions":
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    chars, token_ids = prompt_size(endpoint, body)
    sequences = prompt_sequences(endpoint, body)
    choices *= sequences
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        body=body,
        raw=raw,
        prompt_chars=chars,
        prompt_token_ids=token_ids,
        choices=choices,
        longest_prompt=None if sequences == 1 else max(len(p) for p in body["prompt"]),
    )


def _plain_fields(endpoint: Endpoint, body: dict[str, Any]) -> tuple[str, bool, bool, int | None, int] | None:
    """(model, stream, include_usage, max tokens, choices) read straight from a body whose checked fields
    all have the plain shape the schema accepts (the common case: a few type checks instead of
    the pydantic validation, about 10 us, on every request); ``None`` for anything else, which
    the schema then judges (and words the 400 for).

    Sound, not complete: what it accepts the schema accepts with the same values
    (``tests/fuzz/test_plain_parse.py`` checks it against the schema); it hands the schema any
    doubt (a model name that is not ASCII, a non-ASCII prompt string, an unusual prompt shape).
    ``body`` is ``load_object`` output, so a value's type is exactly one of JSON's.
    """
    model = body.get("model")
    if type(model) is not str or not model or not model.isascii():
        return None
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        return None
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if type(options) is not dict:
            return None
        flag = options.get("include_usage")
        if flag is not None and type(flag) is not bool:
            return None
        include_usage = flag is True
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS_LIMIT):
        return None
    cap = body.get("max_completion_tokens")
    if cap is not None:
        if type(cap) is not int or not 1 <= cap <= MAX_TOKENS_LIMIT:
            return None
        max_tokens = cap
    choices = body.get("n", 1)
    if choices is None:
        choices = 1
    elif type(choices) is not int or not 1 <= choices <= MAX_CHOICES:
        return None
    if endpoint == "chat":
        messages = body.get("messages")
        if type(messages) is not list or not messages or any(type(m) is not dict for m in messages):
            return None
    elif not _plain_prompt(body.get("prompt")):
        return None
    return model, stream is True, include_usage, max_tokens, choices


def _plain_prompt(prompt: object) -> bool:
    """An ASCII string, a list of ASCII strings, of token ids or of lists of token ids."""
    if type(prompt) is str:
        return prompt.isascii()
    if type(prompt) is not list:
        return False
    return (
        all(type(p) is str and p.isascii() for p in prompt)
        or all(type(p) is int for p in prompt)
        or all(type(p) is list and all(type(t) is int for t in p) for p in prompt)
    )


def prompt_size(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[int, int | None]:
    """(characters of prompt text, prompt tokens when given as token ids else ``None``).

    Chat: the text of every message (string content and ``text`` parts; images and other parts
    count nothing). Completions: the string(s), or the token ids' count. Cheap (no tokenizer):
    the prediction service turns characters into tokens with a ratio learned from usage reports.
    Expects a body that ``parse_request`` validated.
    """
    if endpoint == "chat":
        return sum(_message_chars(m) for m in body.get("messages") or ()), None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt), None
    if not isinstance(prompt, list) or not prompt:
        return 0, None
    if all(isinstance(p, str) for p in prompt):
        return sum(len(p) for p in prompt), None
    if all(isinstance(p, list) for p in prompt):
        return 0, sum(len(p) for p in prompt)
    return 0, len(prompt)


def prompt_sequences(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """How many prompts the body sends (>= 1), each decoded as its own sequence (``n`` times):
    the items of a completions ``prompt`` that is a list of strings or of token-id lists; 1 for a
    chat, a string, a flat list of token ids or an empty list. Expects a validated body."""
    if endpoint != "completions":
        return 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _message_chars(message: object) -> int:
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    return sum(
        len(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
    )


def _invalid_from(exc: ValidationError) -> InvalidRequest:
    """The first validation problem as a 400: ``"<field path>: <what is wrong>"``, ``param=<field>``."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    field = loc[0] if loc else None
    path = ".".join(loc)
    message = field_problem(first)
    if field == "prompt" and first["type"] != "missing":
        # A union reports one error per member; name the accepted shapes instead.
        path = "prompt"
        message = "must be a string, a list of strings, a list of token ids or a list of lists of them"
    return InvalidRequest(f"{path}: {message}" if path else message, param=field)


def upstream_path(request: ParsedRequest) -> str:
    """The replica path a request goes to: its endpoint's, except that a native TGI request that
    asked for a stream on ``/generate`` or ``/`` goes to ``/generate_stream`` (TGI's ``/generate``
    ignores ``stream``)."""
    if request.native:
        return "/generate_stream" if request.stream else "/generate"
    return ENDPOINT_PATHS[request.endpoint]


def with_max_tokens(request: ParsedRequest, max_tokens: int) -> ParsedRequest:
    """``request`` (an OpenAI one sent without ``max_tokens``) as the gateway forwards it with
    ``max_tokens`` set (``upstream_body`` writes it into the body)."""
    return replace(request, max_tokens=max_tokens, max_tokens_set=max_tokens)


def upstream_body(request: ParsedRequest) -> bytes:
    """The body sent to the replica: the client's bytes, except that a stream always asks for
    usage and a ``max_tokens`` the gateway set (``with_max_tokens``) is written in.

    Sluice needs the real prompt and completion token counts, so a streaming request goes out with
    ``stream_options.include_usage = true``; the proxy strips that usage chunk from the client's
    stream when the client did not ask for it. A member the body lacks is written into the
    client's bytes; one it has is set in the decoded body, which is encoded again
    (``gateway.api.tgi.with_members``).
    """
    members = _upstream_members(request)
    return request.raw if members is None else with_members(request.body, request.raw, members)


async def encode_upstream_body(request: ParsedRequest) -> bytes:
    """``upstream_body(request)``; a body of ``OFF_LOOP_BYTES`` or more that must be encoded again
    (not only written into) is encoded on the body-parsing thread, where it was decoded, a piece
    at a time (``json_bytes_in_pieces``), so that the event loop waits for neither."""
    members = _upstream_members(request)
    if members is None:
        return request.raw
    if len(request.raw) < OFF_LOOP_BYTES or appendable(request.body, request.raw, members):
        return with_members(request.body, request.raw, members)
    encode = partial(with_members, request.body, request.raw, members, json_bytes_in_pieces)
    return await asyncio.get_running_loop().run_in_executor(_PARSER, encode)


def _upstream_members(request: ParsedRequest) -> dict[str, object] | None:
    """The top-level members ``upstream_body`` sets; ``None`` when the client's bytes go out as
    they are."""
    if request.native:
        return generate_members(request.body, stream=request.stream, details=request.details)
    members: dict[str, object] = {}
    if request.stream and not request.include_usage:
        options = request.body.get("stream_options")
        members["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if request.max_tokens_set is not None:
        members["max_tokens"] = request.max_tokens_set
    return members or None
