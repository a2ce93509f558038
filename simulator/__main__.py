"""``python -m simulator --profile NAME --port N [--engine vllm|tgi|sglang]``: run one emulated replica."""

from simulator.cli import main

raise SystemExit(main())
