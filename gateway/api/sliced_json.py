"""A large JSON text decoded in slices, so that the thread decoding it hands the GIL back often.

``json``'s C decoder holds the GIL for the whole text: an 8 MiB chat body is one C call of tens of
milliseconds, and an event loop waiting for the GIL meanwhile stalls (``/healthz`` included).
``decode_in_slices`` walks the top-level container and the arrays directly inside it with the
standard library's own pure-Python object and array parsers (``json.decoder.JSONObject`` and
``JSONArray``, the reference its C scanner agrees with), and hands each of their members and
elements to the decoder's C scanner: one C call per message of a chat, per prompt of a completions
list, and Python bytecode between them, where the interpreter switches threads. The result, and
every error (type, message, position), are ``decoder.decode``'s. A single member that is itself
huge (one message with thousands of content parts) is still one C call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json import decoder as _decoder
from typing import Any, Final

__all__ = ["decode_in_slices"]

#: ``(value, end)`` from the value starting at ``idx`` of ``s``; raises ``StopIteration(idx)``
#: when none starts there (``json.scanner``'s contract).
Scan = Callable[[str, int], tuple[Any, int]]

# The standard library's pure-Python parsers and whitespace matcher (typeshed declares none).
_parse_object: Final[Callable[..., tuple[Any, int]]] = _decoder.JSONObject  # type: ignore[attr-defined]
_parse_array: Final[Callable[..., tuple[Any, int]]] = _decoder.JSONArray  # type: ignore[attr-defined]
_WHITESPACE: Final[Callable[[str, int], re.Match[str]]] = _decoder.WHITESPACE.match  # type: ignore[attr-defined]


def decode_in_slices(decoder: json.JSONDecoder, text: str) -> Any:
    """``decoder.decode(text)``, the same value or the same ``JSONDecodeError`` (or the scanner's
    ``ValueError`` / ``RecursionError``), decoded a member and an element at a time (see the
    module). ``decoder``'s hooks (``parse_float``, ``parse_constant``, ``object_hook``,
    ``object_pairs_hook``) apply throughout; its ``scan_once`` must be the scanner
    ``json.JSONDecoder`` builds for it."""
    c_scan: Scan = decoder.scan_once  # type: ignore[attr-defined]

    def inner(s: str, idx: int) -> tuple[Any, int]:
        # A member of the top level: an array is walked element by element, anything else is one call.
        if s.startswith("[", idx):
            return _parse_array((s, idx + 1), c_scan)
        return c_scan(s, idx)

    idx = _WHITESPACE(text, 0).end()
    try:
        if text.startswith("{", idx):
            value, end = _parse_object(
                (text, idx + 1),
                decoder.strict,
                inner,
                decoder.object_hook,
                decoder.object_pairs_hook,
                {},
            )
        elif text.startswith("[", idx):
            value, end = _parse_array((text, idx + 1), inner)
        else:
            value, end = c_scan(text, idx)
    except StopIteration as err:
        raise json.JSONDecodeError("Expecting value", text, err.value) from None
    end = _WHITESPACE(text, end).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value
