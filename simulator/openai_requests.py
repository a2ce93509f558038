"""Request parsing and validation for ``/v1/completions`` and ``/v1/chat/completions``, as
vLLM's OpenAI server validates (pure functions).

``parse_completion_request`` / ``parse_chat_request`` turn a JSON body into the engine's
``GenerationRequest`` or raise the ``ApiError`` vLLM 0.32 would answer with (same status,
``param`` and message, checks in vLLM's order). Only the fields the emulator acts on are read;
every other OpenAI/vLLM field is accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from simulator import tokens
from simulator.openai_errors import (
    BodyParseError,
    prompt_too_long_error,
    request_validation_error,
    validation_error,
)
from simulator.replica import ApiError, GenerationRequest

#: vLLM's default ``max_tokens`` for ``/v1/completions`` (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(BaseModel):
    """The request fields the emulator acts on; every other OpenAI/vLLM field is accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0


class _CompletionBody(_SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class _ChatMessages(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[_ChatMessage]


# Bases in this order put ``messages`` first, as in vLLM's ChatCompletionRequest: the first
# validation error names the body's ``param``.
class _ChatBody(_SamplingFields, _ChatMessages):
    max_completion_tokens: int | None = None


def check_content_type(content_type: str | None) -> str:
    """vLLM's ``validate_json_request``: a generation body must be typed ``application/json``.

    Returns the media type (``application/json``); raises vLLM's 400 for any other or none.
    """
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise request_validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])
    return media_type


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or the 400 FastAPI gives (through vLLM's handler).

    Empty: ``missing`` at ``body``; not JSON: ``json_invalid`` at ``body.<position>``; not an
    object: ``model_attributes_type`` at ``body``; not UTF-8: :class:`BodyParseError`.
    """
    if not raw:
        raise request_validation_error(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise request_validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from None
    except UnicodeDecodeError:
        raise BodyParseError(BodyParseError.DETAIL) from None
    if not isinstance(body, dict):
        raise request_validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body,
                }
            ]
        )
    return body


def _body_errors(exc: ValidationError) -> ApiError:
    """pydantic's errors for a body, located under ``body`` as FastAPI reports them."""
    errors: list[Mapping[str, Any]] = [
        {**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False, include_context=True)
    ]
    return request_validation_error(errors)


def validate_model(requested: str | None, served: str) -> None:
    """vLLM serves a request that names no model with its (only) served model."""
    if requested and requested != served:
        raise ApiError(
            f"The model `{requested}` does not exist. Valid aliases: {served}.",
            status=404,
            err_type="NotFoundError",
            param="model",
        )


def _validate_stream_options(fields: _SamplingFields) -> None:
    # A "before" validator of vLLM's request models: it runs ahead of the model check.
    if fields.stream_options is not None and not fields.stream:
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", parameter="stream_options"
        )


def _check_output_limit(requested: int | None, *, param: str, max_model_len: int) -> None:
    """vLLM's ``TokenizeParams`` check: asking for more output than the whole context is a 400."""
    if requested is not None and requested > max_model_len:
        raise validation_error(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            parameter=param,
            value=requested,
        )


def _resolve_max_tokens(
    *, requested: int | None, prompt_tokens: int, max_model_len: int, text_prompt: bool
) -> int:
    """The output cap vLLM 0.32 uses (``get_max_tokens``), or the 400 it gives.

    A prompt longer than the context is refused; otherwise the cap is the request's (``None``:
    no cap) clamped to what the context has left, ``max_model_len - prompt_tokens``: vLLM does not
    refuse a prompt plus ``max_tokens`` that overflow, it stops the output at the context's end
    (``finish_reason="length"``). A cap below 1 (asked for, or a prompt that fills the context)
    is ``SamplingParams``' "max_tokens must be at least 1".
    """
    if prompt_tokens > max_model_len:
        raise prompt_too_long_error(
            max_model_len=max_model_len, prompt_tokens=prompt_tokens, text_prompt=text_prompt
        )
    room = max_model_len - prompt_tokens
    max_tokens = room if requested is None else min(requested, room)
    if max_tokens < 1:
        raise validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.", parameter="max_tokens", value=max_tokens
        )
    return max_tokens


def _check_sampling(fields: _SamplingFields, max_tokens: int) -> None:
    """``SamplingParams``' own checks that the emulator acts on, in vLLM's order."""
    if fields.n < 1:
        raise ApiError(f"n must be at least 1, got {fields.n}.")
    if fields.n > 1:
        raise ApiError(
            f"n={fields.n} is not supported by this replica emulator: it generates one choice per request.",
            param="n",
        )
    if fields.min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {fields.min_tokens}.")
    if fields.min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {fields.min_tokens}."
        )


def _completion_prompt(prompt: list[int] | list[list[int]] | str | list[str] | None) -> str | list[int]:
    """The single prompt of a completion request (a text or token ids)."""
    if prompt is None or prompt == "" or prompt == []:
        raise validation_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt"
        )
    if isinstance(prompt, str):
        return prompt
    first = prompt[0]
    if isinstance(first, int):
        return [int(p) for p in prompt if isinstance(p, int)]
    if len(prompt) > 1:
        raise ApiError(
            f"This replica emulator serves one prompt per request; got a batch of {len(prompt)}.",
            param="prompt",
        )
    if isinstance(first, str):
        if first == "":
            raise validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt"
            )
        return first
    return list(first)


def parse_completion_request(
    body: Mapping[str, Any], *, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a ``POST /v1/completions`` body as vLLM does (raises :class:`ApiError`).

    An absent (or null) ``max_tokens`` is 16, vLLM's default, clamped like an explicit one.
    """
    try:
        req = _CompletionBody.model_validate(body)
    except ValidationError as exc:
        raise _body_errors(exc) from None
    _validate_stream_options(req)
    validate_model(req.model, served_model)
    requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    _check_output_limit(requested, param="max_tokens", max_model_len=max_model_len)
    prompt = _completion_prompt(req.prompt)
    prompt_ids = tokens.completion_prompt_ids(prompt)
    prompt_tokens = len(prompt_ids)
    max_tokens = _resolve_max_tokens(
        requested=requested,
        prompt_tokens=prompt_tokens,
        max_model_len=max_model_len,
        text_prompt=isinstance(prompt, str),
    )
    _check_sampling(req, max_tokens)
    seed_text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
    return _generation_request("completion", req, served_model, prompt_ids, max_tokens, seed_text)


def parse_chat_request(
    body: Mapping[str, Any], *, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a ``POST /v1/chat/completions`` body as vLLM does (raises :class:`ApiError`).

    ``max_completion_tokens`` wins over the deprecated ``max_tokens``; with neither, the output
    may fill the context: ``max_model_len - prompt_tokens`` (vLLM's default for chat).
    """
    try:
        req = _ChatBody.model_validate(body)
    except ValidationError as exc:
        raise _body_errors(exc) from None
    _validate_stream_options(req)
    validate_model(req.model, served_model)
    requested: int | None = req.max_tokens
    param = "max_tokens"
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    _check_output_limit(requested, param=param, max_model_len=max_model_len)
    messages = [m.model_dump() for m in req.messages]
    prompt_ids = tokens.chat_prompt_ids(messages)
    prompt_tokens = len(prompt_ids)
    max_tokens = _resolve_max_tokens(
        requested=requested, prompt_tokens=prompt_tokens, max_model_len=max_model_len, text_prompt=True
    )
    _check_sampling(req, max_tokens)
    seed_text = "\n".join(tokens.message_text(m.get("content")) for m in messages)
    return _generation_request("chat", req, served_model, prompt_ids, max_tokens, seed_text)


def _generation_request(
    kind: Literal["completion", "chat"],
    req: _SamplingFields,
    served_model: str,
    prompt_ids: list[int],
    max_tokens: int,
    seed_text: str,
) -> GenerationRequest:
    options = req.stream_options
    stream = bool(req.stream)
    return GenerationRequest(
        kind=kind,
        model=served_model,
        prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        stream=stream,
        include_usage=stream and options is not None and bool(options.include_usage),
        continuous_usage_stats=stream and options is not None and bool(options.continuous_usage_stats),
        text_seed=tokens.text_seed(seed_text),
        prompt_token_ids=tuple(prompt_ids),
    )
