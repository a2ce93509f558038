"""Where a tokenizer.json is found: a configured path, or the local Hugging Face cache under the
environment's HF_HUB_CACHE / HF_HOME / XDG_CACHE_HOME (temporary folders here, never the user's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.tokens.files import cached_tokenizer, hub_cache_dir, tokenizer_file
from tests.support.tokenizer import write_hub_snapshot, write_tokenizer

MODEL = "acme/Tiny-Chat-1B"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}, "/c/hub", id="hf-hub-cache-first"),
        pytest.param({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/h/hub", id="hf-home"),
        pytest.param({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub", id="xdg"),
        pytest.param({"HF_HOME": ""}, str(Path.home() / ".cache/huggingface/hub"), id="empty-is-unset"),
    ],
)
def test_hub_cache_dir_follows_huggingface_hubs_variables(env: dict[str, str], expected: str) -> None:
    assert hub_cache_dir(env) == Path(expected)


def test_a_snapshot_in_hf_home_is_found(tmp_path: Path) -> None:
    path = write_hub_snapshot(tmp_path / "hub", MODEL)
    assert cached_tokenizer(MODEL, {"HF_HOME": str(tmp_path)}) == path
    assert cached_tokenizer(MODEL, {"HF_HUB_CACHE": str(tmp_path / "hub")}) == path
    assert cached_tokenizer("acme/Other-Model", {"HF_HOME": str(tmp_path)}) is None


def test_the_process_environment_is_read_when_none_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_hub_snapshot(tmp_path / "hub", MODEL)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert cached_tokenizer(MODEL) == path


def test_refs_main_wins_over_a_newer_snapshot(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    main = write_hub_snapshot(hub, MODEL, revision="a" * 40)
    newer = write_tokenizer(main.parents[1] / ("b" * 40))
    os.utime(newer, (main.stat().st_mtime + 10, main.stat().st_mtime + 10))
    assert cached_tokenizer(MODEL, {"HF_HUB_CACHE": str(hub)}) == main


def test_without_refs_the_newest_snapshot_with_a_tokenizer_is_used(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    old = write_hub_snapshot(hub, MODEL, revision="a" * 40)
    (hub / "models--acme--Tiny-Chat-1B" / "refs" / "main").unlink()
    newer = write_tokenizer(old.parents[1] / ("b" * 40))
    os.utime(newer, (old.stat().st_mtime + 10, old.stat().st_mtime + 10))
    (old.parents[1] / ("c" * 40)).mkdir()  # a snapshot without a tokenizer
    assert cached_tokenizer(MODEL, {"HF_HUB_CACHE": str(hub)}) == newer


@pytest.mark.parametrize("name", ["../etc", "acme/../../x", "a/b/c", "/abs", "", "acme/"])
def test_a_name_that_is_not_a_repository_id_is_never_looked_up(tmp_path: Path, name: str) -> None:
    (tmp_path / "hub").mkdir()
    assert cached_tokenizer(name, {"HF_HUB_CACHE": str(tmp_path / "hub")}) is None


def test_tokenizer_file_takes_a_file_or_a_folder_holding_one(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "model")
    assert tokenizer_file(path) == path
    assert tokenizer_file(tmp_path / "model") == path
    assert tokenizer_file(tmp_path) is None
    assert tokenizer_file(tmp_path / "missing.json") is None
