"""The one way a test may skip at run time: :func:`skip_or_fail`.

A skip hides whatever it skips, so in CI (``SLUICE_CI=1``, set by ``.ci/run``) every missing
requirement is a failure instead; so is a missing real vLLM wherever ``SLUICE_REQUIRE_E2E=1``.
Elsewhere (a developer's machine without Prometheus or vLLM) the test skips, and the message
always says what is missing and the command that installs it.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

#: Set to ``1`` by ``.ci/run``: nothing may skip.
CI_ENV = "SLUICE_CI"
#: Set to ``1`` where the e2e suite against a real vLLM must run (CI sets it too).
REQUIRE_E2E_ENV = "SLUICE_REQUIRE_E2E"


def _forcing(require_env: str | None) -> list[str]:
    """The variables among ``SLUICE_CI`` and ``require_env`` that are set to ``1``."""
    names = [CI_ENV] if require_env is None else [CI_ENV, require_env]
    return [name for name in names if os.environ.get(name) == "1"]


def must_run(require_env: str | None = None) -> bool:
    """True when a skip must be a failure: ``SLUICE_CI=1``, or ``require_env`` (if given) is ``1``."""
    return bool(_forcing(require_env))


def skip_or_fail(reason: str, *, install: str, require_env: str | None = None) -> NoReturn:
    """Skip the running test, or fail it when :func:`must_run` (CI).

    ``reason``: what is missing (e.g. ``"promtool is not installed"``). ``install``: how to get it
    (a command, e.g. ``"bash deploy/ci/system-deps.sh"``). ``require_env``: one more variable
    that, set to ``1``, makes this requirement mandatory (e.g. ``SLUICE_REQUIRE_E2E``).
    """
    message = f"{reason}\nto install it: {install}"
    forcing = _forcing(require_env)
    if forcing:
        names = " and ".join(f"{name}=1" for name in forcing)
        pytest.fail(f"{message}\n({names}: a missing requirement is a failure, not a skip)", pytrace=False)
    pytest.skip(message)
