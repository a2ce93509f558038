"""A model's chat template, rendered as ``transformers`` renders it for vLLM, to count a chat exactly.

The template is the Jinja source Hugging Face ships beside ``tokenizer.json``:
``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list
of named templates: ``tool_use`` when the request has tools and it exists, else ``default``).
It is compiled once in a sandbox with ``transformers``' settings (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``; its ``tojson``, ``raise_exception`` and ``strftime_now``),
and rendered with the messages, ``tools``, ``add_generation_prompt`` (default true, as vLLM's),
the request's ``chat_template_kwargs`` and the tokenizer's special tokens (``bos_token``, ...).
A template that does not compile, or a render that raises (a template's ``raise_exception``, an
unexpected shape), gives ``None``: the chat is then counted approximately
(``gateway.tokens.counter``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "load_chat_template"]

log = logging.getLogger("sluice.tokens")

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's compiled chat template(s) and special tokens. Thread-safe (rendering only)."""

    def __init__(
        self, default: jinja2.Template, tool_use: jinja2.Template | None, special: dict[str, str]
    ) -> None:
        self._default = default
        self._tool_use = tool_use
        self._special = special

    def render(self, body: Mapping[str, Any]) -> str | None:
        """The prompt text a chat ``body`` becomes, or ``None`` when the template refuses it."""
        tools = body.get("tools") or None
        template = self._tool_use if tools is not None and self._tool_use is not None else self._default
        extra = body.get("chat_template_kwargs")
        kwargs = dict(extra) if isinstance(extra, Mapping) else {}
        add_generation_prompt = body.get("add_generation_prompt", True)
        try:
            return template.render(
                **{**self._special, **kwargs},
                messages=body["messages"],
                tools=tools,
                add_generation_prompt=add_generation_prompt is not False,
            )
        except Exception:
            return None


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template beside a ``tokenizer.json`` in ``folder``, compiled; ``None`` when there
    is none or it does not compile (logged)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    sources: dict[str, str] = {}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        sources["default"] = jinja_file.read_text(encoding="utf-8")
    else:
        declared = config.get("chat_template")
        if isinstance(declared, str):
            sources["default"] = declared
        elif isinstance(declared, list):
            for item in declared:
                if isinstance(item, dict) and isinstance(item.get("template"), str):
                    sources[str(item.get("name", "default"))] = item["template"]
    if "default" not in sources:
        return None
    special = {name: text for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    env = _environment()
    try:
        tool_use = sources.get("tool_use")
        return ChatTemplate(
            env.from_string(sources["default"]),
            None if tool_use is None else env.from_string(tool_use),
            special,
        )
    except jinja2.exceptions.TemplateError as exc:
        log.warning(
            "the chat template in %s does not compile (%s); chats are counted approximately", folder, exc
        )
        return None
