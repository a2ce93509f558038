"""What reading a replica's ``/metrics`` costs the gateway: prometheus_client's parser against
``ExpositionParser`` (the same result, the layout of the replica's last scrape reused), in one run.

The gateway scrapes every replica every ``scrape.interval_s`` (1 s by default) and parses the text
in a worker thread, which holds the GIL from the event loop while it runs: what the parse costs is
CPU taken from the proxy, and latency added to whatever the loop was about to do.

Scrapes: the real vLLM scrapes kept in ``tests/data/metrics`` (0.32 on CPU, 0.10 on CPU), the
SGLang documentation's example, and the TGI emulator's (``python -m simulator --engine tgi``,
started here on a free port, after ``--requests`` generate calls: 35 duration buckets, 100 token
buckets and 1,024 batch-size buckets per family). Each is parsed ``--rounds`` times with its values
changed between rounds (a replica's successive scrapes differ in their values), by each parser;
the table has the median per parse and the share of one core that parse would take at one scrape
a second. Nothing here asserts a speed. Run: ``.venv/bin/python -m bench.scrape_parse``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gateway.replicas.dialects import Samples
from gateway.replicas.exposition import ExpositionParser, parse_exposition
from tests.support.procs import free_port, python_module, running

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "metrics"
FILES = {
    "vLLM 0.32 (CPU, real)": "vllm-cpu-real-0.32.0.txt",
    "vLLM 0.10 (CPU, real)": "vllm-v0-0.10-cpu-qwen3-full-scrape.txt",
    "SGLang 0.4 (docs)": "sglang-v0.4-docs-production_metrics.txt",
}
_VALUE = re.compile(r"(?<= )[^ ]+$")


def revalued(text: str, rng: random.Random) -> str:
    """``text`` with every sample line's value replaced by another number."""
    return "\n".join(
        line
        if not line.strip() or line.startswith("#")
        else _VALUE.sub(lambda _: repr(rng.uniform(0, 1e6)), line)
        for line in text.split("\n")
    )


def tgi_scrape(requests: int) -> str:
    """The TGI emulator's ``/metrics`` after ``requests`` ``/generate`` calls."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = python_module("simulator", "--profile", "llama3-8b-h100", "--engine", "tgi", "--port", str(port))
    with running(args, base + "/health", name="emulator-tgi"):
        body = json.dumps({"inputs": "a b c " * 40, "parameters": {"max_new_tokens": 8}}).encode()
        for _ in range(requests):
            request = urllib.request.Request(base + "/generate", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=30).read()
        return str(urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())


def _read(samples: Samples) -> dict[str, object]:
    return {name: samples.select(name) for name in samples.names()}


def median_ms(parse: Callable[[str], Samples], texts: list[str]) -> float:
    times = []
    for text in texts:
        start = time.perf_counter()
        parse(text)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="parses per scrape and parser (>= 1)")
    parser.add_argument("--requests", type=int, default=20, help="generate calls before the TGI scrape")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 0:
        parser.error("--rounds must be >= 1 and --requests >= 0")
    scrapes = {label: (DATA / name).read_text(encoding="utf-8") for label, name in FILES.items()}
    scrapes["TGI emulator"] = tgi_scrape(args.requests)
    print(f"scrape parse cost: {args.rounds} parses per scrape and parser, values changed between them")
    print(f"{'scrape':<24}{'lines':>7}{'library ms':>12}{'kept ms':>10}{'ratio':>8}{'library core %':>16}")
    for label, text in scrapes.items():
        rng = random.Random(label)
        texts = [text] + [revalued(text, rng) for _ in range(args.rounds)]
        kept = ExpositionParser()
        kept.parse(texts[0])  # the first scrape of a replica: the library's parse, its layout kept
        fast = median_ms(kept.parse, texts[1:])
        slow = median_ms(parse_exposition, texts[1:])
        assert kept.hits == args.rounds, (label, kept.hits)  # every later scrape reused the layout
        assert all(_read(kept.parse(t)) == _read(parse_exposition(t)) for t in texts[-2:])
        lines = text.count("\n")
        print(f"{label:<24}{lines:>7}{slow:>12.2f}{fast:>10.3f}{slow / fast:>8.0f}{slow / 10:>15.1f}%")
    print("(core %: the library's parse at one scrape a second, scrape.interval_s's default)")


if __name__ == "__main__":
    main()
