"""`sluice serve` with no config (what `make run` starts): the embedded default, and a clean stop.

It binds the documented fixed ports (gateway 8080, emulators 8101 and 8102), so it first checks
that they are free and fails with a clear message if something else holds them.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.stack.conftest import _first_model, _sluice
from tests.support.procs import Proc, port_is_open

pytestmark = pytest.mark.timeout(120)

PORTS = (8080, 8101, 8102)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_embedded_default_serves_and_stops_its_replicas(sig: signal.Signals) -> None:
    busy = [p for p in PORTS if port_is_open(p)]
    assert not busy, f"ports {busy} are taken by another process; the embedded default needs them"
    proc = Proc([*_sluice(), "serve"], name="default")
    try:
        proc.wait_http("http://127.0.0.1:8080/readyz", timeout_s=60)
        model = _first_model("http://127.0.0.1:8080", key="sk-demo")
        req = urllib.request.Request(
            "http://127.0.0.1:8080/v1/chat/completions",
            data=json.dumps(
                {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            # The embedded default has one tenant, `demo`, whose documented key is sk-demo.
            headers={"content-type": "application/json", "Authorization": "Bearer sk-demo"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] > 0
        keyless = urllib.request.Request(
            req.full_url, data=req.data, headers={"content-type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(keyless, timeout=10)
        assert refused.value.code == 401
        banner = proc.output()
        assert "curl" in banner
        assert "Authorization: Bearer sk-demo" in banner
        assert 'OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="sk-demo")' in banner
    finally:
        code = proc.stop(sig, timeout_s=20)
    assert code in (0, -sig, 128 + sig), proc.output()
    deadline = time.monotonic() + 10
    while any(port_is_open(p) for p in PORTS) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in PORTS if port_is_open(p)], "the gateway left its replicas running"
