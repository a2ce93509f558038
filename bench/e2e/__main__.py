"""``python -m bench.e2e``: see ``bench.e2e.core``."""

from bench.e2e.core import main

raise SystemExit(main())
