"""The tiny model build is seeded: a fresh build is byte-identical to the cached one."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.vllm_cpu import BUILD_SCRIPT, MODEL_DIR, ROOT, VENV_PYTHON

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300, func_only=True)]


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in ``folder``, by file name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_rebuild_is_byte_identical(vllm_installed: None, tmp_path: Path) -> None:
    out = tmp_path / "tiny-llama"
    subprocess.run(
        [str(VENV_PYTHON), str(BUILD_SCRIPT), "--out", str(out), "--force"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert digests(out) == digests(MODEL_DIR)


def test_model_matches_recipe(vllm_installed: None) -> None:
    config = json.loads((MODEL_DIR / "config.json").read_text())
    got = {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")}
    assert got == {"vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert (config["max_position_embeddings"], config["dtype"]) == (2048, "bfloat16")
    assert (MODEL_DIR / "chat_template.jinja").is_file()
