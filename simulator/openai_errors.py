"""vLLM's error answers, as its OpenAI server words them: the JSON error body, the 400s for
invalid parameters and over-long prompts, and FastAPI's request-validation message.

Pure: each function returns an ``ApiError`` (status, type, param, message) or a body dict;
``simulator.server`` renders raised ``ApiError``s, ``simulator.openai_bodies`` the mid-stream
event. Wording and bounds follow vLLM 0.32 (sources cited per function).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from simulator.replica import ApiError


class BodyParseError(Exception):
    """A body FastAPI cannot even decode (not UTF-8): 400 with FastAPI's ``{"detail": ...}``."""

    DETAIL: Final = "There was an error parsing the body"


def error_body(message: str, *, status: int, err_type: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's current error body.

    vLLM's ``ErrorResponse``/``ErrorInfo`` in ``vllm/entrypoints/openai/engine/protocol.py``
    (vllm-project/vllm main): ``{"error": {"message", "type", "param", "code"}}``, ``code`` the
    HTTP status as an int, ``type`` e.g. ``"BadRequestError"`` / ``"NotFoundError"``; real 0.3x
    error bodies have this shape. Older versions (before about 0.11) sent a flat
    ``{"object": "error", "message", ...}``; the nested form is the current one.
    """
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def validation_error(message: str, *, parameter: str | None = None, value: object = None) -> ApiError:
    """vLLM's 400 ``BadRequestError`` for a ``VLLMValidationError``.

    Its ``str()`` appends ``(parameter=..., value=...)`` for whichever of the two is set, and the
    body's ``param`` is the parameter (``vllm/exceptions.py``, 0.32).
    """
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return ApiError(f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


def prompt_too_long_error(*, max_model_len: int, prompt_tokens: int, text_prompt: bool) -> ApiError:
    """vLLM 0.32's 400 for a prompt longer than ``max_model_len`` tokens (``param="input_tokens"``).

    A text prompt (a completion string or a rendered chat) is tokenized with truncation to
    ``max_model_len + 1`` tokens, so vLLM only knows it has "at least" that many; a prompt of token
    ids is counted exactly, and says "at least" only when it has exactly ``max_model_len + 1``.
    """
    count = min(prompt_tokens, max_model_len + 1) if text_prompt else prompt_tokens
    qualifier = "at least " if count == max_model_len + 1 else ""
    return validation_error(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {qualifier}{count} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt.",
        parameter="input_tokens",
        value=count,
    )


#: pydantic-core's internal ``loc`` segments, which vLLM drops from ``param`` (vLLM 0.32, Apache-2.0:
#: ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``).
_INTERNAL_LOC_MARKERS: Final = frozenset(
    {
        "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
        "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call", "arguments",
        "is-instance", "is-subclass", "callable", "str", "int", "float", "bool", "bytes", "bytearray",
        "list", "tuple", "dict", "set", "frozenset", "complex", "none", "nonetype",
    }
)  # fmt: skip
_BRACKETED_RE: Final = re.compile(r"[\[\]{}()]")
#: vLLM bounds the errors it reports and the size of each (same file).
_MAX_REPORTED_ERRORS: Final = 10
_MAX_ERROR_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000


def _clean_loc(loc: Sequence[object]) -> str:
    """A pydantic ``loc`` as vLLM's dotted ``param``: ``("body", "max_tokens")`` -> ``body.max_tokens``."""
    parts = [
        str(p) for p in loc if not (_BRACKETED_RE.search(str(p)) or str(p).lower() in _INTERNAL_LOC_MARKERS)
    ]
    return ".".join(parts or [str(p) for p in loc])


def _summarize_input(value: object) -> object:
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _format_error(err: Mapping[str, Any] | str) -> str:
    if isinstance(err, str):
        return err
    shown = dict(err)
    if "input" in shown:
        shown["input"] = _summarize_input(shown["input"])
    shown["loc"] = _clean_loc(shown.get("loc", ()))
    text = str(shown)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def request_validation_error(errors: Sequence[Mapping[str, Any] | str]) -> ApiError:
    """vLLM's 400 for a body FastAPI cannot parse or validate (a ``RequestValidationError``).

    ``errors`` are pydantic's (``loc`` starting with ``"body"``) or plain strings. As vLLM 0.32's
    handler: ``type`` is ``"Bad Request"``, ``param`` the first error's dotted ``loc`` (e.g.
    ``body.37`` for invalid JSON at character 37), the message ``"N validation error(s):"`` with
    one indented line per error.
    """
    first = errors[0] if errors else None
    param = _clean_loc(first["loc"]) if isinstance(first, Mapping) and first.get("loc") else None
    label = "error" if len(errors) == 1 else "errors"
    shown = errors[:_MAX_REPORTED_ERRORS]
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in shown)
    if len(errors) > len(shown):
        message += f"  ...and {len(errors) - len(shown)} more {label}\n"
    return ApiError(message.rstrip(), err_type="Bad Request", param=param)
