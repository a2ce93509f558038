"""What counting a prompt with its tokenizer costs, by prompt length, and what a worker thread adds.

    .venv/bin/python -m bench.prompt_tokens [--tokenizer PATH]

Prints, for prompts of 100 to 100,000 characters of English prose, the best of five timings of
``PromptCounter.count_texts`` (``encode_batch_fast``) in microseconds, what rendering Llama 3's
chat template costs for 2 to 50 messages, and the round trip of an empty ``asyncio.to_thread``
call. ``gateway.tokens.counter.OFF_LOOP_CHARS`` is where the first
passes a few hundred microseconds. Without ``--tokenizer`` it uses the e2e tiny model's BPE,
trained offline (``tests/support/tokenizer.py``): a 2,048-token vocabulary, about 1.2 characters
a token on this text where Llama 3's runs near 4, so real tokenizers cost about as much or less
per character. Runs in a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from gateway.tokens.counter import OFF_LOOP_CHARS, PromptCounter, PromptTexts
from gateway.tokens.template import ChatTemplate, load_chat_template

LENGTHS = (100, 300, 1_000, 3_000, 10_000, 30_000, 100_000)
PROSE = (
    "Sluice admits each request whose forecast meets its class's targets on some replica, queues "
    "it when one should take it in time, and refuses it with a Retry-After otherwise. "
)


def best_us(call: Callable[[], object], budget_s: float = 0.2) -> float:
    """Best of five rounds of ``call``, each repeated to fill ``budget_s`` / 5, in microseconds."""
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    reps = max(1, int(budget_s / 5 / once))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


async def thread_hop_us() -> float:
    """Best round trip of ``asyncio.to_thread`` with nothing to do, in microseconds."""
    best = float("inf")
    for _ in range(200):
        start = time.perf_counter()
        await asyncio.to_thread(int)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


#: Llama 3 Instruct's chat template, as its tokenizer_config.json ships it.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_template() -> ChatTemplate:
    """``LLAMA3_TEMPLATE`` compiled as ``gateway.tokens.template`` compiles a model's."""
    with tempfile.TemporaryDirectory() as folder:
        config = {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>"}
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        template = load_chat_template(Path(folder))
    assert template is not None
    return template


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: the e2e tiny BPE)")
    args = parser.parse_args(argv)
    if args.tokenizer is not None:
        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        from tests.support.tokenizer import tokenizer

        tok = tokenizer()
    counter = PromptCounter(tok)
    print(f"{'chars':>8} {'tokens':>7} {'count us':>9} {'us/char':>8}")
    for chars in LENGTHS:
        text = (PROSE * (chars // len(PROSE) + 1))[:chars]
        texts = PromptTexts([text], True)
        tokens = counter.count_texts(texts).tokens
        cost = best_us(functools.partial(counter.count_texts, texts))
        print(f"{chars:>8} {tokens:>7} {cost:>9.1f} {cost / chars:>8.3f}")
    template = llama3_template()
    for messages in (2, 10, 50):
        body = {"messages": [{"role": "user", "content": PROSE} for _ in range(messages)]}
        cost = best_us(functools.partial(template.render, body))
        print(f"chat template, {messages:>2} messages: {cost:8.1f} us ({cost / messages:.1f} us a message)")
    print(f"asyncio.to_thread round trip: {asyncio.run(thread_hop_us()):.1f} us")
    print(f"OFF_LOOP_CHARS = {OFF_LOOP_CHARS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
