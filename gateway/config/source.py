"""Reading a configuration file: its error type, its text and the strict YAML loader.

Shared by ``gateway.config.load`` (the main YAML) and ``gateway.tenants.keys_file`` (the keys file),
below both. ``ConfigError`` is re-exported by ``gateway.config.load``, where callers catch it.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ConfigError", "StrictSafeLoader", "read_text"]


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` holds every violation, one line each."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.path = str(path)
        self.problems = list(problems)
        super().__init__(self.path, self.problems)

    def __str__(self) -> str:
        count = len(self.problems)
        header = f"{self.path}: {count} problem{'' if count == 1 else 's'} in configuration"
        return header + "".join(f"\n  {problem}" for problem in self.problems)


def read_text(path: str | Path) -> str:
    """The file at ``path`` as text (UTF-8, a BOM dropped); ``ConfigError`` naming ``path`` when it
    cannot be read or is not UTF-8 (the line and column of the first bad byte)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(path, ["file not found"]) from None
    except IsADirectoryError:
        raise ConfigError(path, ["is a directory, not a file"]) from None
    except OSError as exc:
        raise ConfigError(path, [f"cannot read file: {exc.strerror or exc}"]) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = raw[exc.start : exc.end]
        raise ConfigError(
            path, [f"line {line}, column {column}: not valid UTF-8 text (got {bad!r})"]
        ) from None


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, plus: a key repeated in one mapping is an error.

    Plain YAML keeps the last value silently, so a second ``server:`` block would quietly discard
    the first; an operator wants to hear about it.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first_line: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r}, first defined at line {first_line[key]}",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)
