"""A real ``tokenizer.json`` built offline: the e2e tiny model's byte-level BPE.

Trained in-process with the ``tokenizers`` library from the seeded corpus of
``deploy/vllm-cpu/build_tiny_model.py`` (its recipe without ``transformers``: vocabulary 2048,
``<unk> <s> </s> <pad>``, a ``<s>`` post-processor), so the tests count with the very tokenizer
the real vLLM on CPU serves. Trained once per test session (about a second).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

_BUILDER = Path(__file__).resolve().parents[2] / "deploy" / "vllm-cpu" / "build_tiny_model.py"


@functools.cache
def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_tiny_model", _BUILDER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def tokenizer_json() -> str:
    """The serialised tokenizer (``tokenizer.json``'s text)."""
    recipe = _recipe()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.VOCAB_SIZE,
        special_tokens=recipe.SPECIAL_TOKENS,
        initial_alphabet=[],
        show_progress=False,
    )
    tok.train_from_iterator(recipe.build_corpus(random.Random(recipe.SEED)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok.to_str()


def tokenizer() -> Tokenizer:
    """A fresh ``Tokenizer`` from ``tokenizer_json()``."""
    return Tokenizer.from_str(tokenizer_json())


def write_tokenizer(folder: Path) -> Path:
    """``folder/tokenizer.json`` (and a ``tokenizer_config.json`` as Hugging Face saves one),
    folder created; returns the ``tokenizer.json`` path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    path.write_text(tokenizer_json(), encoding="utf-8")
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": _recipe().CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def write_hub_snapshot(hub: Path, model_id: str, revision: str = "0" * 40) -> Path:
    """The tokenizer as ``huggingface_hub`` caches ``model_id`` under ``hub`` (``refs/main`` and
    ``snapshots/<revision>/``); returns the ``tokenizer.json`` path."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision, encoding="ascii")
    return write_tokenizer(repo / "snapshots" / revision)
