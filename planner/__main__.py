"""``python -m planner``: ``sluice plan`` (``planner.cli``)."""

import sys

from planner.cli import main

sys.exit(main())
