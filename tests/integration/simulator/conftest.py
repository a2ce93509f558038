"""Start the replica emulator as a real process (``python -m simulator``) for the tests here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from simulator.profile import load_profile

ROOT = Path(__file__).resolve().parents[3]
READY_RE = re.compile(r"ready on (http://[^\s:]+:\d+)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

#: The emulated replica: a real profile, narrowed so that 12 concurrent requests queue
#: (running 4, waiting 8), with the max_model_len of the real 0.32 scrape.
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 1024


@dataclass
class Emulator:
    process: subprocess.Popen[bytes]
    base_url: str
    model: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait; the exit code (the process is killed if it hangs)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                return self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                pytest.fail(f"emulator ignored signal {sig} for {STOP_TIMEOUT_S} s:\n{self.log()}")
        return self.process.returncode


def write_profile(directory: Path) -> tuple[Path, str]:
    """A profile YAML derived from a shipped one; returns its path and served model name."""
    profile = load_profile("llama3-8b-h100").with_engine(
        max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN
    )
    path = directory / "emulator-test.yaml"
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return path, profile.served_model_name


def start_emulator(profile_path: Path, model: str, log_path: Path, *extra: str) -> Emulator:
    """Run ``python -m simulator --port 0`` and wait for its ready line (which has the real port)."""
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "simulator",
            "--profile",
            str(profile_path),
            "--port",
            "0",
            "--seed",
            "7",
            *extra,
        ],
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log_file.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = READY_RE.search(log_path.read_text(errors="replace"))
        if match:
            return Emulator(process, match.group(1), model, log_path)
        if process.poll() is not None:
            pytest.fail(f"emulator exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    process.kill()
    process.wait()
    pytest.fail(f"emulator not ready after {START_TIMEOUT_S} s:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    directory = tmp_path_factory.mktemp("emulator")
    profile_path, model = write_profile(directory)
    emu = start_emulator(profile_path, model, directory / "emulator.log")
    try:
        yield emu
    finally:
        emu.stop()
