"""``python -m bench.goodput``: see ``bench.goodput.core``."""

from bench.goodput.core import main

raise SystemExit(main())
