"""The API server's own CPU work in front of one emulated engine, and whose CPU it runs on.

A real vLLM's OpenAI server tokenises each prompt before the engine sees the request, and
detokenises and frames every streamed token; on a CPU host that work shares the cores with the
engine's steps. ``ApiServerCosts`` says how much work that is; ``ApiServerQueue`` is the engine's
bookkeeping of it on the engine's injected clock (no I/O, no wall clock). All costs 0 (the
default) is the plain engine: nothing is queued and every timing is unchanged.

Two contention modes (``contention``):

* ``"shared"``: one CPU for the API server and the engine. The API work pending when the engine
  builds a step (the prompts that arrived since, and the framing of the tokens the previous step
  produced) runs first: it is added to that step's duration, and the prompts it tokenised join
  that step.
* ``"separate"``: the API server has its own core, one FIFO worker. A prompt enters the engine
  when the worker has tokenised it (after the work queued before it, framing included); the
  engine's steps are not slowed, and an idle engine waits for the next prompt to be ready.

The rules and suggested values are in docs/emulator.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Contention = Literal["shared", "separate"]
CONTENTION_MODES: tuple[Contention, ...] = ("shared", "separate")

NonNegative = Annotated[float, Field(ge=0)]


class ApiServerCosts(BaseModel):
    """CPU seconds of the API server's work per request, per token and per step (all 0: none).

    Frozen; unknown keys are refused (it is the ``api_server`` section of a profile).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_request_s: NonNegative = Field(
        default=0.0,
        description="Fixed work of one request before the engine sees it (HTTP parsing, request "
        "validation, chat template, the hand-off to the engine), seconds.",
    )
    per_prompt_token_s: NonNegative = Field(
        default=0.0, description="Tokenisation work per prompt token, seconds per token."
    )
    per_output_token_s: NonNegative = Field(
        default=0.0,
        description="Detokenisation and SSE framing work per streamed output token, seconds per token.",
    )
    per_step_s: NonNegative = Field(
        default=0.0,
        description="Work per engine step that produced tokens, whatever their number: receiving and "
        "decoding the engine's outputs (vLLM's output handler wakes once per step), seconds.",
    )
    contention: Contention = Field(
        default="shared",
        description="'shared': the work runs on the engine's CPU and delays its steps; "
        "'separate': it runs beside the engine, on a core of its own.",
    )

    @property
    def enabled(self) -> bool:
        """Whether any work is modelled (False: the engine behaves exactly as without this)."""
        costs = (self.per_request_s, self.per_prompt_token_s, self.per_output_token_s, self.per_step_s)
        return any(c > 0 for c in costs)

    def intake_s(self, prompt_tokens: int) -> float:
        """Seconds of work before a request of ``prompt_tokens`` tokens reaches the engine."""
        return self.per_request_s + self.per_prompt_token_s * prompt_tokens

    def stream_s(self, num_tokens: int) -> float:
        """Seconds of work for one step's ``num_tokens`` output tokens: the step's share (none
        for a step without tokens) plus detokenising and framing each."""
        if num_tokens <= 0:
            return 0.0
        return self.per_step_s + self.per_output_token_s * num_tokens


@dataclass(slots=True)
class _Intake:
    """A request being tokenised: ``work_s`` of intake work; ``ready_s`` when it reaches the
    engine (``separate`` only: fixed on arrival; ``shared``: decided by the step that does it)."""

    request_id: str
    work_s: float
    ready_s: float


@dataclass(frozen=True, slots=True)
class Prelude:
    """What the API server does before the engine's next step.

    ``start_s``: when the step's computation starts (``now`` + the prelude). ``ready``: the
    requests that reach the engine by then, in arrival order, each with when it did (its
    tokenisation's end; ``start_s`` on a shared CPU, where the prelude's work is not ordered).
    """

    start_s: float
    ready: tuple[tuple[str, float], ...]


class ApiServerQueue:
    """The API server's pending work in front of one engine, in the engine's clock (seconds).

    The engine calls ``admit`` for each new request, ``prelude`` when it builds a step,
    ``streamed`` when a step's tokens land, ``drop`` when a request is aborted before it got in,
    and ``idle`` when it has nothing to run. Not thread-safe.
    """

    def __init__(self, costs: ApiServerCosts) -> None:
        self.costs = costs
        self._intake: deque[_Intake] = deque()
        #: ``separate``: when the API worker finishes the work queued so far.
        self._free_at = -math.inf
        #: ``shared``: framing work of landed tokens not yet run.
        self._stream_backlog_s = 0.0

    def __len__(self) -> int:
        """Requests still being tokenised (not yet in the engine)."""
        return len(self._intake)

    def __contains__(self, request_id: object) -> bool:
        return any(i.request_id == request_id for i in self._intake)

    def admit(self, request_id: str, prompt_tokens: int, now: float) -> None:
        """A request of ``prompt_tokens`` tokens arrives at ``now``: queue its tokenisation."""
        work = self.costs.intake_s(prompt_tokens)
        ready = now
        if self.costs.contention == "separate":
            ready = max(now, self._free_at) + work
            self._free_at = ready
        self._intake.append(_Intake(request_id, work, ready))

    def drop(self, request_id: str) -> bool:
        """Forget a request still being tokenised (aborted); False if it is not here.

        ``separate``: the worker's time is already committed; later requests keep their times.
        """
        for entry in self._intake:
            if entry.request_id == request_id:
                self._intake.remove(entry)
                return True
        return False

    def streamed(self, num_tokens: int, now: float) -> None:
        """A step that ended at ``now`` produced ``num_tokens`` tokens to detokenise and frame."""
        work = self.costs.stream_s(num_tokens)
        if work <= 0:
            return
        if self.costs.contention == "separate":
            self._free_at = max(now, self._free_at) + work
        else:
            self._stream_backlog_s += work

    def idle(self) -> None:
        """The engine has nothing to run: framing left over ran on the otherwise idle CPU."""
        self._stream_backlog_s = 0.0

    def prelude(self, now: float, *, engine_busy: bool) -> Prelude:
        """The work run before a step built at ``now``, and the requests that reach the engine.

        ``engine_busy``: whether the engine has requests to run without the ones queued here.
        ``shared``: every pending prompt is tokenised and the pending framing done first, so the
        step starts after all of it. ``separate``: the prompts whose tokenisation has ended by
        ``now`` get in; when the engine has nothing else to run it waits for the next one.
        """
        if self.costs.contention == "shared":
            start = now + self._stream_backlog_s + sum(i.work_s for i in self._intake)
            ready = tuple((i.request_id, start) for i in self._intake)
            self._intake.clear()
            self._stream_backlog_s = 0.0
            return Prelude(start, ready)
        start = now
        if not engine_busy and self._intake:
            start = max(now, self._intake[0].ready_s)
        got: list[tuple[str, float]] = []
        while self._intake and self._intake[0].ready_s <= start:
            entry = self._intake.popleft()
            got.append((entry.request_id, entry.ready_s))
        return Prelude(start, tuple(got))
