"""``python -m bench.closed_loop``: see ``bench.closed_loop.core``."""

from bench.closed_loop.cli import main

raise SystemExit(main())
