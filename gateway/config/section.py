"""The building blocks of every configuration section: the strict ``Section`` base, common
field types, and the cross-field violation types validators raise.

They live apart from ``gateway.config.settings`` so that the section modules of other packages
(``gateway.admission.config``, ``gateway.limits.config``, ``gateway.tenants.config``) can build
on them while ``gateway.config.settings`` mounts those sections: no import cycle.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveSeconds = Annotated[float, Field(gt=0)]
#: A host name or IP address: non-empty, no whitespace.
Host = Annotated[str, Field(pattern=r"^\S+$")]
#: A Hugging Face model id, ``owner/name``.
HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Violation:
    """One broken cross-field rule.

    ``path`` is relative to the model whose validator found it (``("timeout_s",)`` inside
    ``health``); ``value`` is the offending value, shown to the operator.
    """

    path: tuple[str | int, ...]
    message: str
    value: object


class SettingsViolations(ValueError):
    """Raised by model validators; carries every cross-field violation found, not just the first."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        super().__init__(
            "; ".join(
                f"{'.'.join(str(p) for p in v.path) or '(top level)'}: {v.message} (got {v.value!r})"
                for v in self.violations
            )
        )


def not_above(section: BaseModel, low: str, high: str) -> list[Violation]:
    """The violation of ``section.low <= section.high`` (say ``min_s`` and ``max_s``), reported at
    ``low`` with ``high``'s value in its message; ``[]`` when the rule holds."""
    low_value, high_value = getattr(section, low), getattr(section, high)
    if low_value <= high_value:
        return []
    return [Violation((low,), f"must not exceed {high} ({high_value!r})", low_value)]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable, types are strict."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
