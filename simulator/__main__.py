"""``python -m simulator --profile NAME --port N``: run one emulated vLLM replica."""

from simulator.server import main

raise SystemExit(main())
