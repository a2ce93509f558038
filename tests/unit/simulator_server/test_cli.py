"""`python -m simulator` / `sluice sim` argument and startup failures (no server is left running)."""

from __future__ import annotations

import socket

import pytest

from simulator.cli import main


def test_unknown_profile_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--profile", "no-such-profile", "--port", "0"]) == 2
    assert "cannot load profile 'no-such-profile'" in capsys.readouterr().err


def test_missing_profile_argument_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2


def test_port_in_use_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--profile", "llama3-8b-h100", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
