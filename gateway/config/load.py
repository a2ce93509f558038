"""Load and validate the YAML configuration, reporting every problem at once.

``load_settings`` is the one entry point used by ``sluice serve``, ``sluice check-config`` and the
reloader, so the three can never disagree about what a valid file is. Each problem is one line,
``<dotted.path>: <message> (got <offending value>)``, e.g.::

    replicas.0.url: String should match pattern '^https?://[^/\\s]+(/[^\\s]*)?$' (got 'localhost:8000')
    server.prot: unknown key; did you mean 'port'? (got 8080)

YAML syntax problems use ``line L, column C`` (1-based) in place of the dotted path.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from gateway.config.settings import Settings, SettingsViolations
from gateway.config.source import ConfigError, StrictSafeLoader, read_text
from gateway.replicas.config import EmulatorSettings, HardwareSettings
from gateway.tenants import apply_keys_file, demo_tenants

__all__ = ["MAX_VALUE_CHARS", "ConfigError", "default_settings", "load_settings", "parse_settings"]

#: Longest rendering of an offending value, in characters; longer ones are cut with "...".
MAX_VALUE_CHARS = 80

_MAPPING_TYPES = frozenset({"model_type", "dict_type", "model_attributes_type"})


def default_settings() -> Settings:
    """The embedded default of ``sluice serve`` without ``--config`` (``config/demo.yaml`` equals it).

    The gateway on 127.0.0.1:8080 in front of two emulated llama3-8b-h100 replicas on ports 8101
    and 8102, with fixed seeds and 2 % step-time jitter so runs are repeatable but not robotic.
    The predictor is told what an operator would know of such a replica: an H100-SXM serving
    Llama-3-8B with the engine limits vLLM was launched with (the profile's ``engine:`` section).
    One tenant, ``demo``, whose API key is ``sk-demo`` (``gateway.tenants.demo_tenants``): keys are
    required, and its budgets are generous enough for the README's examples and a demo load.
    """
    hardware = HardwareSettings(
        gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
    )
    return Settings(
        emulators=[
            EmulatorSettings(
                name="emu-0", profile="llama3-8b-h100", port=8101, seed=0, jitter=0.02, hardware=hardware
            ),
            EmulatorSettings(
                name="emu-1", profile="llama3-8b-h100", port=8102, seed=1, jitter=0.02, hardware=hardware
            ),
        ],
        tenants=demo_tenants(),
    )


def load_settings(path: str | Path) -> Settings:
    """Read the YAML file at ``path`` and validate it; raises ``ConfigError`` listing every problem.

    When ``tenants.keys_file`` names a keys file (relative paths: from ``path``'s directory), its
    hashes are validated and added to their tenants' ``api_keys`` here, so ``serve``,
    ``check-config`` and every reload read it with the rest (``ConfigError`` names the keys file).
    """
    text = read_text(path)
    settings = parse_settings(_parse_yaml(text, path), str(path))
    return _with_keys_file(settings, Path(path).parent)


def _with_keys_file(settings: Settings, base_dir: Path) -> Settings:
    tenants = apply_keys_file(settings.tenants, base_dir)
    if tenants is settings.tenants:
        return settings
    # Validated rule by rule by apply_keys_file; a copy keeps the snapshot frozen and exact.
    return settings.model_copy(update={"tenants": tenants})


def parse_settings(data: object, source: str) -> Settings:
    """Validate already-parsed data (``None`` means an empty document); ``source`` names it in errors."""
    if data is None:
        raise ConfigError(source, ["file is empty: expected a mapping of sections such as `replicas:`"])
    if not isinstance(data, dict):
        raise ConfigError(
            source, [f"(top level): expected a mapping of sections such as `replicas:` (got {_show(data)})"]
        )
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
    problems = [line for error in errors for line in _describe(error)]
    raise ConfigError(source, problems + _fleet_problems(data, errors))


def _fleet_problems(data: dict[Any, Any], errors: list[ErrorDetails]) -> list[str]:
    """The whole-file rules (names, ports, at least one replica) when other sections failed.

    Pydantic runs ``Settings``' own validator only when every field is valid, which would hide a
    duplicate replica name behind a typo in ``health``. The rules read only ``replicas``,
    ``emulators`` and ``server.port``; when those are valid, check them alone.
    """
    if any(_touches_fleet(tuple(error["loc"])) for error in errors):
        return []
    fleet: dict[str, Any] = {key: data[key] for key in ("replicas", "emulators") if key in data}
    server = data.get("server")
    if isinstance(server, dict) and "port" in server:
        fleet["server"] = {"port": server["port"]}
    try:
        Settings.model_validate(fleet)
    except ValidationError as exc:
        return [line for error in exc.errors() for line in _describe(error)]
    return []


def _touches_fleet(loc: tuple[str | int, ...]) -> bool:
    return loc[:1] in {("replicas",), ("emulators",)} or loc in {(), ("server",), ("server", "port")}


def _parse_yaml(text: str, path: str | Path) -> object:
    try:
        # A SafeLoader subclass: as safe as yaml.safe_load, plus duplicate-key errors.
        return yaml.load(text, Loader=StrictSafeLoader)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(path, [_describe_yaml_error(exc, text)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, [f"invalid YAML: {exc}"]) from None


def _describe_yaml_error(exc: yaml.MarkedYAMLError, text: str) -> str:
    """``line L, column C: invalid YAML: <problem>[; <context>] (got <the offending line>)``."""
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "syntax error"
    message = f"invalid YAML: {problem}"
    if exc.context and exc.problem:
        message += f"; {exc.context}"
        if exc.context_mark is not None:
            message += f" started at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
    if mark is None:
        return message
    lines = text.splitlines()
    got = _show(lines[mark.line]) if mark.line < len(lines) else "end of file"
    return f"line {mark.line + 1}, column {mark.column + 1}: {message} (got {got})"


def _describe(error: ErrorDetails) -> list[str]:
    """One line per violation in a pydantic error (a cross-field error may hold several)."""
    loc = tuple(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, SettingsViolations):
        return [f"{_dotted(loc + v.path)}: {v.message} (got {_show(v.value)})" for v in cause.violations]
    path = _dotted(loc)
    kind = error["type"]
    if kind == "missing":
        return [f"{path}: required key is missing"]
    if kind == "extra_forbidden":
        message = "unknown key" + _suggestion(loc)
    elif kind in _MAPPING_TYPES:
        message = "should be a mapping of keys to values"
    else:
        message = error["msg"].removeprefix("Value error, ")
    return [f"{path}: {message} (got {_show(error['input'])})"]


def _dotted(loc: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _show(value: object) -> str:
    """``repr`` of an offending value, cut to ``MAX_VALUE_CHARS`` characters."""
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def _suggestion(loc: tuple[str | int, ...]) -> str:
    """``"; did you mean 'port'?"`` for a near-miss of a known key at ``loc``, else ``""``."""
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The settings model that validates the mapping at ``loc``, or ``None`` when there is none."""
    current: object = Settings
    for part in loc:
        origin, args = typing.get_origin(current), typing.get_args(current)
        if origin is dict and len(args) == 2:
            current = args[1]  # a named entry of a map (e.g. admission.classes.<name>)
        elif isinstance(part, int):
            current = args[0] if origin is list and args else None
        elif isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = current.model_fields[part].annotation
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None
