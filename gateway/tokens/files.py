"""Where a model's ``tokenizer.json`` is: a configured path, or the local Hugging Face cache.

Nothing here downloads: a model whose tokenizer is in neither place has its prompts estimated.
The cache is the one ``huggingface_hub`` writes (``hf download``, ``vllm serve``):
``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``; a model ``org/name`` is in ``models--org--name/snapshots/<rev>/``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = ["TOKENIZER_FILE", "cached_tokenizer", "hub_cache_dir", "tokenizer_file"]

TOKENIZER_FILE: Final = "tokenizer.json"
#: A Hugging Face repository id (``org/name`` or a bare ``name``): nothing else is looked up, so a
#: model name can never name a path outside the cache.
_REPO_ID: Final = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def tokenizer_file(path: str | os.PathLike[str]) -> Path | None:
    """``path`` itself when it is a file, ``path/tokenizer.json`` when ``path`` is a folder that
    holds one; ``None`` otherwise (missing, or a folder without it). ``~`` is expanded."""
    where = Path(path).expanduser()
    if where.is_file():
        return where
    inside = where / TOKENIZER_FILE
    return inside if inside.is_file() else None


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The local Hugging Face hub cache ``huggingface_hub`` uses under ``env`` (default: this
    process's environment), whether or not it exists."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def cached_tokenizer(model_id: str, env: Mapping[str, str] | None = None) -> Path | None:
    """The ``tokenizer.json`` of ``model_id`` (a Hugging Face id) in the local hub cache, or
    ``None``: the snapshot ``refs/main`` names when it has one, else the most recently modified
    snapshot that has one. ``None`` for a name that is not a repository id (``..``, slashes)."""
    if not _REPO_ID.match(model_id) or ".." in model_id:
        return None
    repo = hub_cache_dir(env) / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    if main and _REPO_ID.match(main) and (found := tokenizer_file(snapshots / main)) is not None:
        return found
    try:
        candidates = [p for p in snapshots.glob(f"*/{TOKENIZER_FILE}") if p.is_file()]
    except OSError:
        return None
    return max(candidates, key=_mtime, default=None)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
