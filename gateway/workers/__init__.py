"""Several gateway processes on one port (``server.workers``): what a worker is told by the
supervisor (``supervisor.py``) through its environment.

A process started with ``WORKER_ENV`` set is worker number ``worker_index()`` (0 to N-1) of
``worker_count()``: it binds its listeners with ``SO_REUSEPORT``, starts no emulator (the
supervisor runs them once), keeps 1/N of every tenant budget when they are in memory, and stops
by itself, draining, once the supervisor (``PARENT_ENV``) is gone.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["COUNT_ENV", "PARENT_ENV", "WORKER_ENV", "supervisor_pid", "worker_count", "worker_index"]

#: This process's worker index, 0 to N-1, set by the supervisor only.
WORKER_ENV: Final = "SLUICE_WORKER"
#: The supervisor's process id, set by the supervisor only.
PARENT_ENV: Final = "SLUICE_WORKER_PARENT"
#: How many workers the supervisor runs, set by the supervisor only.
COUNT_ENV: Final = "SLUICE_WORKER_COUNT"


def worker_index() -> int | None:
    """This process's worker index; ``None`` when it is no worker (one process, or the supervisor)."""
    text = os.environ.get(WORKER_ENV, "").strip()
    return int(text) if text.isdigit() else None


def worker_count() -> int:
    """How many workers serve this process's port: N in a worker, 1 otherwise."""
    text = os.environ.get(COUNT_ENV, "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 and worker_index() is not None else 1


def supervisor_pid() -> int | None:
    """The supervisor's process id when this process is a worker; ``None`` otherwise."""
    text = os.environ.get(PARENT_ENV, "").strip()
    return int(text) if text.isdigit() and worker_index() is not None else None
