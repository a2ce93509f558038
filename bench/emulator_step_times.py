"""The replica emulator's step time against batch size, per profile: the curve its realism rests on.

    .venv/bin/python -m bench.emulator_step_times

For each profile it prints the modelled step time of a pure-decode step with B sequences at a
1,024-token context (B = 1 ... max_num_seqs), and of a prefill-only step of N tokens. The
decode column shows the flat, weight-bound region and the knee; tokens/s for one stream is
1 / step(B=1). No timing of this machine is involved: these are the cost model's numbers.
"""

from __future__ import annotations

from simulator.costmodel import CostModel, StepShape
from simulator.profile import list_profiles, load_profile

CONTEXT_TOKENS = 1024
BATCHES = (1, 8, 32, 64, 128, 256)
PREFILLS = (128, 512, 2048, 8192)


def decode_ms(model: CostModel, batch: int) -> float:
    """Step time in ms of ``batch`` sequences decoding one token each at CONTEXT_TOKENS."""
    return 1e3 * model.step_time_s(StepShape(decode_contexts=(CONTEXT_TOKENS + 1,) * batch))


def prefill_ms(model: CostModel, tokens: int) -> float:
    """Step time in ms of one prompt chunk of ``tokens`` on an empty cache."""
    return 1e3 * model.step_time_s(StepShape(prefill_chunks=((tokens, 0),)))


def main() -> None:
    print(f"decode step, ms (context {CONTEXT_TOKENS} tokens per sequence)\n")
    print("| profile | " + " | ".join(f"B={b}" for b in BATCHES) + " | tok/s, one stream |")
    print("|---|" + "---|" * (len(BATCHES) + 1))
    for name in list_profiles():
        model = CostModel(load_profile(name))
        cells = " | ".join(f"{decode_ms(model, b):.2f}" for b in BATCHES)
        print(f"| {name} | {cells} | {1e3 / decode_ms(model, 1):.0f} |")
    print("\nprefill-only step, ms\n")
    print("| profile | " + " | ".join(f"N={n}" for n in PREFILLS) + " |")
    print("|---|" + "---|" * len(PREFILLS))
    for name in list_profiles():
        model = CostModel(load_profile(name))
        print(f"| {name} | " + " | ".join(f"{prefill_ms(model, n):.1f}" for n in PREFILLS) + " |")


if __name__ == "__main__":
    main()
