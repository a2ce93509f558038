"""Clipping what a client sent before it is echoed back or logged.

A 1 MB model name was echoed whole in a 404 body and in two 1 MB log lines. Every value taken from
a request (a model name, a header, a method) goes through ``clip`` before it lands in an error
message or a log field; ``gateway.http.errors`` also caps every client-facing message and every
logged detail, whatever built them.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ECHO_LIMIT", "MESSAGE_LIMIT", "clip"]

#: Characters of a client's value kept when it is echoed or logged.
ECHO_LIMIT: Final = 256
#: Characters of an error message (or a logged detail) kept, whatever built it.
MESSAGE_LIMIT: Final = 2048


def clip(value: str, limit: int = ECHO_LIMIT) -> str:
    """``value`` itself when it has at most ``limit`` characters (>= 1), else its first ``limit``
    characters and a marker saying how many were left out: ``"abc…[+1021 chars]"``."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}…[+{len(value) - limit} chars]"
