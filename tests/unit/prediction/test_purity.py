"""The prediction service is pure like the predictor: importing it loads no I/O library."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("aiohttp", "redis", "prometheus_client", "simulator", "asyncio")


def test_importing_the_prediction_service_loads_no_io_library() -> None:
    code = (
        "import json, sys\n"
        "import gateway.prediction, gateway.prediction.service, gateway.prediction.state\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    assert loaded.isdisjoint(FORBIDDEN), loaded & set(FORBIDDEN)
