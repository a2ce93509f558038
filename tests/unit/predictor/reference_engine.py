"""A slow, step-by-step engine used only to cross-check the forecast's closed form.

Each step: every decoding sequence takes one token of the budget, the rest goes to prefill chunks
FCFS; a request whose prompt completes joins the decodes (its first token is sampled in that step).
Step times come from the same ``StepModel``. Nothing finishes (the closed form's prefill part
ignores finishing too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from predictor.step_model import StepBatch, StepModel


@dataclass
class Engine:
    budget: int
    decode_contexts: list[int]
    queue: list[list[int]] = field(default_factory=list)  # [remaining, done]

    def step(self, model: StepModel) -> tuple[float, list[int]]:
        """Run one step; return (its time, indexes of queue entries whose prompt completed)."""
        n = len(self.decode_contexts)
        room = self.budget - n
        prefill = 0
        pairs = 0.0
        completed: list[int] = []
        for i, entry in enumerate(self.queue):
            if room <= 0:
                break
            if entry[0] == 0:
                continue
            chunk = min(room, entry[0])
            pairs += chunk * (chunk / 2.0 + entry[1])
            entry[0] -= chunk
            entry[1] += chunk
            prefill += chunk
            room -= chunk
            if entry[0] == 0:
                completed.append(i)
        t = model.step_time(StepBatch(prefill, n, sum(self.decode_contexts), pairs))
        self.decode_contexts = [c + 1 for c in self.decode_contexts]
        self.decode_contexts += [self.queue[i][1] for i in completed]
        return t, completed


def simulate_ttft(
    model: StepModel, budget: int, contexts: list[int], queue_prompts: list[int], prompt: int
) -> tuple[float, int, float]:
    """(TTFT of ``prompt`` behind ``queue_prompts``, steps taken, stall it adds to running decodes).

    The stall is the difference in summed step time, over the same steps, between running with
    and without the candidate.
    """
    with_it = Engine(budget, list(contexts), [[p, 0] for p in [*queue_prompts, prompt]])
    without = Engine(budget, list(contexts), [[p, 0] for p in queue_prompts])
    me = len(queue_prompts)
    ttft = stall = 0.0
    steps = 0
    while True:
        t, done = with_it.step(model)
        t0, _ = without.step(model)
        steps += 1
        ttft += t
        if with_it.queue[me][1] > 0:  # its chunks were in this step
            stall += t - t0
        if me in done:
            return ttft, steps, stall
