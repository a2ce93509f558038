"""Build a tiny random Llama that a real vLLM can serve on CPU, fully offline.

Run with the vLLM venv's interpreter (it needs torch, tokenizers and transformers)::

    .cache/vllm-cpu/venv/bin/python deploy/vllm-cpu/build_tiny_model.py [--out DIR] [--force]

Writes into ``DIR`` (default ``<repo>/.cache/vllm-cpu/tiny-llama``):

- a byte-level BPE tokenizer (vocabulary 2048, special tokens ``<unk> <s> </s> <pad>``, a BOS
  post-processor and a ``<|role|>`` chat template), trained on a seeded generated ASCII corpus;
- a random ``LlamaForCausalLM`` (hidden 256, 2 layers, 4 heads, 2048 positions, bf16, ~2.4 M
  parameters, ~5 MB) initialised from a fixed seed.

The result is byte-identical on every run. A stamp file records a hash of this script, so a second
run with an unchanged script is instant; ``--force`` rebuilds anyway. The folder is replaced
atomically (built next to it, then renamed), so a reader never sees half a model.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / ".cache" / "vllm-cpu" / "tiny-llama"
STAMP_NAME = ".sluice-build-stamp"

SEED = 20261130
VOCAB_SIZE = 2048
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

#: ``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n`` when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SYLLABLES = [
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "qu", "an", "el", "in", "on", "un",
    "the", "and", "ing", "ion", "ent", "est", "ver", "ter", "pro", "con", "per", "sta", "tra",
]  # fmt: skip


def build_corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    """Return ``lines`` lines of pseudo-English ASCII text drawn from ``rng``.

    Words, digits, punctuation, newlines inside chat markers and every printable ASCII character
    appear, so the tokenizer covers any ASCII input and a random model only emits ASCII.
    """
    printable = [chr(c) for c in range(32, 127)]
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(1500)]
    corpus = ["".join(printable), "<|system|>\n<|user|>\n<|assistant|>\n"]
    for _ in range(lines):
        n = rng.randint(4, 16)
        parts = [rng.choice(words) for _ in range(n)]
        if rng.random() < 0.3:
            parts.append(str(rng.randint(0, 99999)))
        sentence = " ".join(parts)
        corpus.append(sentence.capitalize() + rng.choice([".", "!", "?", ",", ":", ";"]) + "\n")
    return corpus


def build_tokenizer(corpus: list[str]) -> object:
    """Train and return a ``transformers.PreTrainedTokenizerFast`` of exactly ``VOCAB_SIZE`` ids."""
    # Only the vLLM venv has these; the project's mypy runs without them.
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No 256-byte initial alphabet: only bytes seen in the ASCII corpus get ids, so whatever ids a
    # random model samples decode to valid text.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=[],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    if len(fast) != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {len(fast)} ids, expected {VOCAB_SIZE}: enlarge the corpus")
    return fast


def build_model(tokenizer: object, out: Path) -> None:
    """Initialise the random Llama from ``SEED`` and save it (bf16 safetensors) into ``out``."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found,unused-ignore]

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def script_digest() -> str:
    """Return the SHA-256 of this file: a changed recipe invalidates an existing build."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def is_built(out: Path) -> bool:
    """True when ``out`` holds a build made by this exact script."""
    stamp = out / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == script_digest()


def build(out: Path) -> None:
    """Build the tokenizer and model into a sibling temporary folder, then swap it into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    try:
        tokenizer = build_tokenizer(build_corpus(random.Random(SEED)))
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
        build_model(tokenizer, tmp)
        (tmp / STAMP_NAME).write_text(script_digest() + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model folder to write")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    if not args.force and is_built(out):
        return 0
    build(out)
    print(f"built tiny Llama into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
