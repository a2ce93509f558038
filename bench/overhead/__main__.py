"""``python -m bench.overhead``: see ``bench.overhead.core``."""

from bench.overhead.core import main

raise SystemExit(main())
