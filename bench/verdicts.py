"""A benchmark target's verdict: met, not met, or not met for want of data.

The goodput and overhead benches report every target they hold, always: a target whose inputs
were not measured (a missing cell, a zero or missing baseline for a ratio) is reported
``NO_DATA``, which counts as not met, never left out and never passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Status", "Verdict", "judge", "missing"]


class Status(StrEnum):
    """What a target's check found (the value is the text the reports print)."""

    MET = "met"
    NOT_MET = "not met"
    NO_DATA = "not met (no data)"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One target's verdict.

    ``target``: the target in words; ``status``: the verdict; ``detail``: the figures it rests on,
    or, for ``NO_DATA``, what was missing; ``value``: the figure compared with the target (a
    ratio, milliseconds...), ``None`` when there was none.
    """

    target: str
    status: Status
    detail: str
    value: float | None = None

    @property
    def met(self) -> bool:
        return self.status is Status.MET

    def line(self) -> str:
        """The verdict as a markdown list item: ``- <target>: <detail> -> **<status>**``."""
        return f"- {self.target}: {self.detail} -> **{self.status}**"


def judge(target: str, value: float, holds: bool, detail: str) -> Verdict:
    """``MET`` when ``holds`` (the caller's comparison of ``value`` with the target), else
    ``NOT_MET``; ``NO_DATA`` when ``value`` is NaN, which no comparison can judge."""
    if math.isnan(value):
        return missing(target, f"{detail}: the figure is not a number")
    return Verdict(target, Status.MET if holds else Status.NOT_MET, detail, value)


def missing(target: str, why: str) -> Verdict:
    """A ``NO_DATA`` verdict; ``why`` says what was not measured."""
    return Verdict(target, Status.NO_DATA, why)
