"""The configuration reference, ``docs/configuration.md``, rendered from the settings models.

``render()`` walks ``Settings`` field by field and returns the Markdown: one ``##`` section per
top-level key, in the order of ``Settings``' fields, and a heading one level deeper per nested
section, list of sections (``replicas[]``), map of sections (``admission.classes.<name>``) or
choice of forms (``limits.token_weights``). Each holds a table of its plain keys: dotted path,
type (with the bounds, length and pattern the model enforces), default as YAML spells it, and
description, ending "Restart required." where ``gateway.config.reload.RESTART_ONLY`` says a
reload keeps the running value. ``key_paths()`` lists the dotted path of every such key.

Regenerate the file with ``python -m gateway.config.reference > docs/configuration.md``;
``tests/unit/config/test_reference.py`` fails while the committed file differs from ``render()``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel, Tag
from pydantic.fields import FieldInfo

from gateway.config.reload import RESTART_ONLY
from gateway.config.settings import Settings

__all__ = ["REGENERATE", "key_paths", "main", "render"]

#: The command that rewrites the committed reference.
REGENERATE: Final = "python -m gateway.config.reference > docs/configuration.md"
#: What a key or section read only at start-up says, when its description does not already.
RESTART: Final = "Restart required."

_SCALARS: Final[dict[type, tuple[str, str]]] = {
    bool: ("boolean", "booleans"),
    int: ("integer", "integers"),
    float: ("number", "numbers"),
    str: ("string", "strings"),
}


@dataclass(frozen=True)
class _Shape:
    """What one annotation holds, ``None`` and ``Annotated`` wrappers removed.

    ``kind`` is ``scalar`` (``base``), ``choice`` (``choices``), ``list`` or ``map`` (``item``),
    ``model`` (one entry in ``models``) or ``forms`` (several tagged ``models``). ``constraints``
    are the ``annotated_types`` and pydantic metadata found on the way down.
    """

    kind: Literal["scalar", "choice", "list", "map", "model", "forms"]
    nullable: bool
    constraints: tuple[Any, ...]
    base: type | None = None
    choices: tuple[object, ...] = ()
    item: _Shape | None = None
    models: tuple[tuple[str, type[BaseModel]], ...] = ()


def _unwrap(annotation: Any) -> tuple[Any, list[Any], str | None]:
    """``annotation`` without ``Annotated``: the inner type, its metadata and its ``Tag``, if any."""
    metadata: list[Any] = []
    tag = None
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        for item in extra:
            if isinstance(item, FieldInfo):
                metadata += item.metadata
            elif isinstance(item, Tag):
                tag = item.tag
            else:
                metadata.append(item)
    return annotation, metadata, tag


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _shape(annotation: Any, constraints: tuple[Any, ...] = ()) -> _Shape:
    """The shape of ``annotation``; ``constraints`` are those already known (the field's own)."""
    annotation, metadata, _ = _unwrap(annotation)
    found = (*constraints, *metadata)
    nullable = False
    if get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        nullable = len(members) < len(get_args(annotation))
        if len(members) == 1:
            inner = _shape(members[0], found)
            return _Shape(**{**inner.__dict__, "nullable": True})
        forms = [_unwrap(member) for member in members]
        if not all(_is_model(inner) for inner, _, _ in forms):
            raise TypeError(f"cannot describe the union {annotation!r}")
        models = tuple((tag or inner.__name__, inner) for inner, _, tag in forms)
        return _Shape("forms", nullable, found, models=models)
    origin = get_origin(annotation)
    if origin is Literal:
        return _Shape("choice", nullable, found, choices=get_args(annotation))
    if origin is list:
        return _Shape("list", nullable, found, item=_shape(get_args(annotation)[0]))
    if origin is dict:
        return _Shape("map", nullable, found, item=_shape(get_args(annotation)[1]))
    if _is_model(annotation):
        return _Shape("model", nullable, found, models=(("", annotation),))
    if annotation in _SCALARS:
        return _Shape("scalar", nullable, found, base=annotation)
    raise TypeError(f"cannot describe the type {annotation!r}")


def _field_shape(field: FieldInfo) -> _Shape:
    return _shape(field.annotation, tuple(field.metadata))


def _sections(shape: _Shape) -> tuple[str, tuple[tuple[str, type[BaseModel]], ...]] | None:
    """For a field holding sections: the path suffix (``""``, ``[]``, ``.<name>``) and the
    (form name, model) pairs; ``None`` for a field holding a plain value."""
    if shape.kind in ("model", "forms"):
        return "", shape.models
    if shape.kind in ("list", "map") and shape.item is not None and shape.item.kind == "model":
        return ("[]" if shape.kind == "list" else ".<name>"), shape.item.models
    return None


def _bounds(constraints: tuple[Any, ...]) -> str:
    """``"from 0 to 65535"``, ``"> 0 and <= 1"``, ``">= 1"``: the tightest bound on each side."""
    lower: tuple[Any, bool] | None = None  # (value, inclusive)
    upper: tuple[Any, bool] | None = None
    for item in constraints:
        value: Any
        if isinstance(item, annotated_types.Gt | annotated_types.Ge):
            value, inclusive = (item.gt, False) if isinstance(item, annotated_types.Gt) else (item.ge, True)
            if lower is None or value > lower[0] or (value == lower[0] and not inclusive):
                lower = (value, inclusive)
        elif isinstance(item, annotated_types.Lt | annotated_types.Le):
            value, inclusive = (item.lt, False) if isinstance(item, annotated_types.Lt) else (item.le, True)
            if upper is None or value < upper[0] or (value == upper[0] and not inclusive):
                upper = (value, inclusive)
    if lower is not None and upper is not None and lower[1] and upper[1]:
        return f"from {lower[0]!r} to {upper[0]!r}"
    parts = []
    if lower is not None:
        parts.append(f"{'>=' if lower[1] else '>'} {lower[0]!r}")
    if upper is not None:
        parts.append(f"{'<=' if upper[1] else '<'} {upper[0]!r}")
    return " and ".join(parts)


def _code(text: str) -> str:
    """``text`` as an inline code span, even when it holds backticks."""
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _string_rules(constraints: tuple[Any, ...]) -> list[str]:
    """``"of 1 to 64 characters"``, ``"non-empty"``, ``"matching `re`"``: a string's length and pattern."""
    low = max(
        (item.min_length for item in constraints if isinstance(item, annotated_types.MinLen)), default=0
    )
    high = min(
        (item.max_length for item in constraints if isinstance(item, annotated_types.MaxLen)), default=None
    )
    rules = []
    if high is not None:
        rules.append(f"of {low} to {high} characters" if low else f"of at most {high} characters")
    elif low:
        rules.append("non-empty" if low == 1 else f"of at least {low} characters")
    rules += [f"matching {_code(item.pattern)}" for item in constraints if getattr(item, "pattern", None)]
    return rules


def _type_text(shape: _Shape, plural: bool = False) -> str:
    """The type as a user reads it: ``integer from 0 to 65535``, ``one of `a`, `b` ``, ``or `null` ``."""
    if shape.kind == "choice" and len(shape.choices) == 1:
        text = _code(_yaml(shape.choices[0]))
    elif shape.kind == "choice":
        text = "one of " + ", ".join(_code(_yaml(choice)) for choice in shape.choices)
    elif shape.kind == "list" and shape.item is not None:
        text = f"list of {_type_text(shape.item, plural=True)}"
    elif shape.kind == "map" and shape.item is not None:
        text = f"map of names to {_type_text(shape.item, plural=True)}"
    elif shape.kind in ("model", "forms"):
        text = "sections" if plural else "section"
    else:
        assert shape.base is not None
        text = _SCALARS[shape.base][1 if plural else 0]
        rules = [rule for rule in (_bounds(shape.constraints), *_string_rules(shape.constraints)) if rule]
        if rules[:1] == ["non-empty"]:
            text, rules = f"non-empty {text}", rules[1:]
        text = " ".join([text, ", ".join(rules)]).strip()
    return f"{text}, or `null`" if shape.nullable else text


def _yaml(value: object) -> str:
    """``value`` as YAML spells it on one line."""
    dumped: str = yaml.safe_dump(value, default_flow_style=True, sort_keys=False)
    return dumped.removesuffix("\n").removesuffix("\n...").strip()


def _default(field: FieldInfo) -> object:
    return field.get_default(call_default_factory=True, validated_data={})


def _default_text(field: FieldInfo) -> str:
    return "required" if field.is_required() else _code(_yaml(_default(field)))


def _prose(text: str) -> str:
    """``text`` safe in a Markdown table cell: pipes escaped, and ``<``, ``*`` outside code spans."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):
        parts[index] = parts[index].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts).replace("|", "\\|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _restart_only(path: str) -> bool:
    """Whether a reload keeps the running value at ``path``: it or a section above it is in
    ``gateway.config.reload.RESTART_ONLY``."""
    plain = path.replace("[]", "")
    return any(plain == key or plain.startswith(f"{key}.") for key in RESTART_ONLY)


def _described(path: str, field: FieldInfo) -> str:
    """The field's description, with ``RESTART`` added where a reload keeps the running value."""
    text = (field.description or "").strip()
    if _restart_only(path) and RESTART.rstrip(".") not in text:
        text = f"{text} {RESTART}".strip()
    return text


@dataclass(frozen=True)
class _Block:
    """One heading's worth: the path of the section, what to say about it, its forms' keys."""

    path: str
    depth: int
    intro: str
    forms: tuple[tuple[str, tuple[tuple[str, FieldInfo], ...]], ...]


def _keys(
    model: type[BaseModel],
) -> Iterator[tuple[str, FieldInfo, tuple[str, tuple[tuple[str, type[BaseModel]], ...]] | None]]:
    """Each field of ``model``: its name, its ``FieldInfo`` and, for a section field, ``_sections``."""
    for name, field in model.model_fields.items():
        yield name, field, _sections(_field_shape(field))


def _intro(path: str, field: FieldInfo, shape: _Shape, suffix: str) -> str:
    """What a section's heading is followed by: its description, then what it holds and its default."""
    default = None if field.is_required() else _default(field)
    if suffix == "[]":
        holds = f"A list, `{_yaml(default)}` by default; each entry has the keys below."
    elif suffix == ".<name>" and isinstance(default, dict) and default:
        dumped: object = {
            name: item.model_dump(mode="json", exclude_defaults=True) for name, item in default.items()
        }
        if "[]" not in path and "<name>" not in path.removesuffix(suffix):
            for part in reversed(path.removesuffix(suffix).split(".")):
                dumped = {part: dumped}
        holds = (
            "A map from names you choose to sections with the keys below. The default, where every "
            "key not shown takes its default below:\n\n```yaml\n"
            + yaml.safe_dump(dumped, sort_keys=False)
            + "```"
        )
    elif suffix == ".<name>":
        holds = f"A map from names you choose to sections with the keys below, `{_yaml(default)}` by default."
    else:
        what = "One of the forms below" if shape.kind == "forms" else "A section with the keys below"
        holds = f"{what}, or `null` (`{_yaml(default)}` by default)." if shape.nullable else ""
    return "\n\n".join(part for part in (_prose(_described(path, field)), holds) if part)


def _blocks(model: type[BaseModel], prefix: str, depth: int) -> Iterator[_Block]:
    """The blocks of every section field of ``model``, depth first, in field order."""
    for name, field, sections in _keys(model):
        if sections is None:
            continue
        suffix, models = sections
        path = f"{prefix}{name}{suffix}"
        forms = tuple(
            (form, tuple((f"{path}.{key}", child) for key, child, sub in _keys(section) if sub is None))
            for form, section in models
        )
        yield _Block(path, depth, _intro(path, field, _field_shape(field), suffix), forms)
        for _, section in models:
            yield from _blocks(section, f"{path}.", depth + 1)


def _table(rows: tuple[tuple[str, FieldInfo], ...]) -> str:
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for path, field in rows:
        cells = (
            _cell(_code(path)),
            _cell(_type_text(_field_shape(field))),
            _cell(_default_text(field)),
            _prose(_described(path, field)),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _render_block(block: _Block) -> str:
    title = f"`{block.path}`" if block.path else "Top-level keys"
    parts = [f"{'#' * (block.depth + 2)} {title}", block.intro]
    for form, rows in block.forms:
        if form:
            parts.append(f"Form `{form}`:")
        if rows:
            parts.append(_table(rows))
    return "\n\n".join(part for part in parts if part)


def _header() -> str:
    contents = ", ".join(f"[`{name}`](#{name})" for name in Settings.model_fields)
    return f"""# Configuration reference

Every key of Sluice's YAML configuration file, with its type, default and meaning. This file is
generated from the models that validate the configuration (`gateway/config/settings.py` and the
sections it mounts): edit their descriptions, not this file, and regenerate it with
`{REGENERATE}` (`tests/unit/config/test_reference.py` fails while it is out of date).
For an annotated example to start from see `config/sluice.example.yaml`; for the configuration a
gateway would actually run, every key with its value, run `sluice config show` (`sluice config init`
prints only what differs from the defaults; docs/cli.md).

Keys are dotted paths from the top of the file: `replicas[].hardware.gpu` is the `gpu` key of the
`hardware` section of each entry of the `replicas` list, and `<name>` stands for a name you choose
(`tenants.tenants.<name>.weight`). Unknown keys are refused, and values must have their exact type
(a quoted `"8080"` is not a port). Keys marked "Restart required." are read at start-up: a reload
(SIGHUP, or the file watch of `reload.watch`) keeps their running values and logs that a restart is
needed; a reload applies every other key.

Sections: {contents}.
"""


def _all_blocks() -> list[_Block]:
    """Every block of ``Settings``: its plain top-level keys (none today), then each section."""
    top = tuple((name, field) for name, field, sections in _keys(Settings) if sections is None)
    root = [_Block("", 0, "", (("", top),))] if top else []
    return [*root, *_blocks(Settings, "", 0)]


def render() -> str:
    """The Markdown text of ``docs/configuration.md``."""
    return "\n\n".join([_header().rstrip("\n"), *(_render_block(block) for block in _all_blocks())]) + "\n"


def key_paths() -> list[str]:
    """The dotted path of every plain key (one that holds a value, not a section), in render order."""
    return [path for block in _all_blocks() for _, rows in block.forms for path, _ in rows]


def main() -> int:
    """Print the reference on stdout (``python -m gateway.config.reference > docs/configuration.md``)."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
