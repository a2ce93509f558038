"""Fixtures the bench smokes share with the e2e suite.

``vllm_installed``: the real vLLM on CPU and the tiny model are installed (instant when already
there); it skips, or fails under ``SLUICE_CI=1``/``SLUICE_REQUIRE_E2E=1``, when they cannot be.
"""

from __future__ import annotations

from tests.e2e.conftest import vllm_installed

__all__ = ["vllm_installed"]
