"""Label values: which class and tenant names a label may take, and codes made safe as labels.

Label values are bounded so the series count is: unconfigured classes and tenants become
``other``, missing ones ``none``, anything not shaped like a code (``snake_case``, at most 64
characters) ``other``. ``LabelLimits`` holds the configured names; it starts empty (every class
and tenant is ``other`` or ``none``) until ``set`` is called from the configuration.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from gateway.config.settings import Settings

NONE_LABEL: Final = "none"
OTHER_LABEL: Final = "other"
_CODE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def limited(value: str | None, allowed: Collection[str]) -> str:
    """``value`` when it is in ``allowed``; ``none`` for ``None``; else ``other``."""
    if value is None:
        return NONE_LABEL
    return value if value in allowed else OTHER_LABEL


def code_label(value: str | None, default: str = NONE_LABEL) -> str:
    """A code (``snake_case``, at most 64 characters) as a label value; ``default`` for ``None``."""
    if value is None:
        return default
    label = _CODE_LABELS.get(value)
    if label is None:
        label = value if _CODE.match(value) else OTHER_LABEL
        if len(_CODE_LABELS) < _CODE_LABELS_KEPT:  # codes are few; anything else is not kept
            _CODE_LABELS[value] = label
    return label


#: ``code_label``'s answers so far (at most ``_CODE_LABELS_KEPT``): one lookup, not a match.
_CODE_LABELS: dict[str, str] = {}
_CODE_LABELS_KEPT: Final = 1024


def configured_classes(settings: Settings) -> frozenset[str]:
    """Class names in ``settings.admission.classes`` (empty until that section exists)."""
    admission = getattr(settings, "admission", None)
    classes = getattr(admission, "classes", None)
    return frozenset(classes) if isinstance(classes, Mapping) else frozenset()


def configured_tenants(settings: Settings) -> frozenset[str]:
    """Tenant names configured in ``settings.tenants`` (the only values the tenant label takes),
    plus the anonymous tenant when one is configured."""
    tenants = settings.tenants
    names = set(tenants.tenants)
    if tenants.auth.anonymous_tenant is not None:
        names.add(tenants.auth.anonymous_tenant)
    return frozenset(names)


class LabelLimits:
    """The class and tenant names that may appear as label values; empty until ``set``."""

    def __init__(self) -> None:
        self._classes: frozenset[str] = frozenset()
        self._tenants: frozenset[str] = frozenset()

    def set(self, *, classes: Iterable[str] = (), tenants: Iterable[str] = ()) -> None:
        """Replace both sets of names (others become ``other``)."""
        self._classes = frozenset(classes)
        self._tenants = frozenset(tenants)

    def class_label(self, name: str | None) -> str:
        """``name`` when configured, ``none`` for ``None``, else ``other``."""
        return limited(name, self._classes)

    def tenant_label(self, name: str | None) -> str:
        """``name`` when configured (or the anonymous tenant), ``none`` for ``None``, else ``other``."""
        return limited(name, self._tenants)
