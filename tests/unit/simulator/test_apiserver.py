"""API-server costs in front of the engine: exact timings on a fake clock (each step lasts exactly
its ``plan.duration_s``), both contention modes, and nothing changed when the costs are 0."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import yaml
from pydantic import ValidationError

from simulator.apiserver import ApiServerCosts
from simulator.costmodel import CostModel, StepShape
from simulator.engine import Engine, FinishedRequestStats, StepPlan
from simulator.profile import Profile, load_profile
from simulator.replica import system_fingerprint

BASE = load_profile("llama3-8b-h100")
MODEL = CostModel(BASE)

#: Costs large enough to dwarf float noise, small enough to keep the engine's behaviour familiar.
REQ_S, PROMPT_S, OUT_S = 0.010, 1e-5, 2e-3


def costs(
    contention: str = "shared", *, request: float = REQ_S, prompt: float = PROMPT_S, out: float = OUT_S
) -> ApiServerCosts:
    return ApiServerCosts(
        per_request_s=request, per_prompt_token_s=prompt, per_output_token_s=out, contention=contention
    )


def engine(api: ApiServerCosts | None = None, *, seed: int = 0, jitter: float = 0.0) -> Engine:
    profile = BASE if api is None else BASE.with_api_server(api)
    return Engine(profile, seed=seed, jitter=jitter)


@dataclass
class Trace:
    """What a drained engine did: its plans (with the time each was built), first tokens, stats."""

    plans: list[tuple[float, StepPlan]] = field(default_factory=list)
    first_token_s: dict[str, float] = field(default_factory=dict)
    finished: dict[str, FinishedRequestStats] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    now: float = 0.0


def run(eng: Engine, arrivals: list[tuple[float, str, int, int]], trace: Trace | None = None) -> Trace:
    """Drive ``eng`` as the live replica does: requests (at, id, prompt, output) are added at their
    time (between steps, or while the engine idles), each step lasts its ``duration_s``."""
    t = trace or Trace()
    pending = sorted(arrivals)
    while pending or eng.has_unfinished_requests:
        while pending and pending[0][0] <= t.now:
            at, rid, prompt, out = pending.pop(0)
            eng.add_request(rid, prompt, out, out, at)
        plan = eng.schedule(t.now)
        if plan is None:
            t.now = pending[0][0]
            continue
        t.plans.append((t.now, plan))
        t.now += plan.duration_s
        result = eng.complete(plan, t.now)
        for event in result.events:
            t.first_token_s.setdefault(event.request_id, t.now)
        t.finished.update({f.request_id: f for f in result.finished})
        t.finished_at.update({f.request_id: t.now for f in result.finished})
    return t


def prefill_s(prompt: int) -> float:
    return MODEL.step_time_s(StepShape(prefill_chunks=((prompt, 0),)))


def decode_s(*contexts: int) -> float:
    return MODEL.step_time_s(StepShape(decode_contexts=contexts))


# --------------------------------------------------------------------------- configuration


def test_default_costs_are_off_and_shipped_profiles_have_none() -> None:
    assert not ApiServerCosts().enabled
    assert BASE.api_server == ApiServerCosts()
    assert costs().enabled
    assert ApiServerCosts(per_output_token_s=1e-4).enabled
    assert ApiServerCosts(per_step_s=1e-4).enabled


def test_profile_section_parses_and_is_validated() -> None:
    data = BASE.model_dump(mode="json")
    data["api_server"] = {"per_request_s": 0.004, "per_prompt_token_s": 2e-6, "contention": "separate"}
    profile = Profile.model_validate(yaml.safe_load(yaml.safe_dump(data)))
    assert profile.api_server == ApiServerCosts(
        per_request_s=0.004, per_prompt_token_s=2e-6, contention="separate"
    )
    for bad in ({"per_request_s": -1.0}, {"contention": "other"}, {"per_token_s": 1.0}):
        with pytest.raises(ValidationError):
            Profile.model_validate({**data, "api_server": bad})


def test_fingerprint_unchanged_without_costs_and_changed_with_them() -> None:
    off = BASE.with_api_server(ApiServerCosts())
    assert system_fingerprint(off) == system_fingerprint(BASE)
    assert system_fingerprint(BASE.with_api_server(costs())) != system_fingerprint(BASE)


def test_intake_and_stream_arithmetic() -> None:
    c = costs()
    assert c.intake_s(500) == pytest.approx(REQ_S + 500 * PROMPT_S)
    assert c.stream_s(7) == pytest.approx(7 * OUT_S)
    stepped = ApiServerCosts(per_output_token_s=OUT_S, per_step_s=0.003)
    assert stepped.stream_s(7) == pytest.approx(0.003 + 7 * OUT_S)
    assert stepped.stream_s(0) == 0.0


# --------------------------------------------------------------------------- costs off: unchanged


def test_zero_costs_change_no_step_and_no_stat() -> None:
    arrivals = [(0.0, "a", 300, 20), (0.0, "b", 40, 5), (0.013, "c", 900, 12), (0.2, "d", 64, 30)]
    plain = run(engine(seed=3, jitter=0.05), arrivals)
    zero = run(engine(ApiServerCosts(contention="separate"), seed=3, jitter=0.05), arrivals)
    assert [p for _, p in zero.plans] == [p for _, p in plain.plans]
    assert zero.first_token_s == plain.first_token_s
    assert zero.finished == plain.finished


# --------------------------------------------------------------------------- shared CPU


def test_shared_idle_engine_ttft_grows_by_the_tokenisation() -> None:
    prompt = 500
    plain = run(engine(), [(1.0, "a", prompt, 1)])
    shared = run(engine(costs()), [(1.0, "a", prompt, 1)])
    assert plain.first_token_s["a"] == pytest.approx(1.0 + prefill_s(prompt), abs=1e-12)
    assert shared.first_token_s["a"] == pytest.approx(
        1.0 + REQ_S + prompt * PROMPT_S + prefill_s(prompt), abs=1e-12
    )
    ((_, plan),) = shared.plans
    assert plan.api_server_s == pytest.approx(REQ_S + prompt * PROMPT_S, abs=1e-12)
    # The engine counts from when the request reached it, as vLLM's engine does.
    assert shared.finished["a"].ttft_s == pytest.approx(prefill_s(prompt), abs=1e-12)


def test_shared_streaming_slows_every_decode_step_per_running_stream() -> None:
    prompts = (100, 200, 300)
    arrivals = [(0.0, f"r{i}", p, 4) for i, p in enumerate(prompts)]
    plain = run(engine(), arrivals)
    shared = run(engine(costs(request=0.0, prompt=0.0)), arrivals)
    assert len(plain.plans) == len(shared.plans) == 4  # one prefill step, three decode steps
    for (_, off), (_, on) in zip(plain.plans[1:], shared.plans[1:], strict=True):
        assert on.num_decode_seqs == 3
        # The framing of the previous step's three tokens runs before this one.
        assert on.api_server_s == pytest.approx(3 * OUT_S, abs=1e-12)
        assert on.duration_s == pytest.approx(off.duration_s + 3 * OUT_S, abs=1e-12)
    tpot_off = plain.finished["r0"].tpot_s
    tpot_on = shared.finished["r0"].tpot_s
    assert tpot_off is not None
    assert tpot_on is not None
    assert tpot_on == pytest.approx(tpot_off + 3 * OUT_S, abs=1e-12)


def test_shared_per_step_work_is_paid_once_per_step_whatever_the_streams() -> None:
    step_s = 0.004
    arrivals = [(0.0, f"r{i}", p, 4) for i, p in enumerate((100, 200, 300))]
    plain = run(engine(), arrivals)
    shared = run(engine(ApiServerCosts(per_step_s=step_s, per_output_token_s=OUT_S)), arrivals)
    for (_, off), (_, on) in zip(plain.plans[1:], shared.plans[1:], strict=True):
        assert on.api_server_s == pytest.approx(step_s + 3 * OUT_S, abs=1e-12)
        assert on.duration_s == pytest.approx(off.duration_s + step_s + 3 * OUT_S, abs=1e-12)


def test_shared_burst_of_arrivals_delays_the_running_requests_next_step() -> None:
    # "first" is prefilled alone; a burst of four arrives during that step.
    eng = engine(costs(out=0.0))
    burst = [(0.001, f"b{i}", 250, 1) for i in range(4)]
    t = run(eng, [(0.0, "first", 100, 3), *burst])
    (_, first), (_, second) = t.plans[0], t.plans[1]
    assert first.api_server_s == pytest.approx(REQ_S + 100 * PROMPT_S, abs=1e-12)
    # The burst's tokenisation runs before the next step, on the CPU the engine needs.
    assert second.api_server_s == pytest.approx(4 * (REQ_S + 250 * PROMPT_S), abs=1e-12)
    assert set(second.num_scheduled_tokens) == {"first", "b0", "b1", "b2", "b3"}
    for i in range(4):
        # Each waits for the step in flight, then for the whole burst's tokenisation.
        assert t.first_token_s[f"b{i}"] == pytest.approx(t.plans[1][0] + second.duration_s, abs=1e-12)


# --------------------------------------------------------------------------- separate core


def test_separate_tokenises_fifo_and_leaves_steps_alone() -> None:
    prompt = 400
    intake = REQ_S + prompt * PROMPT_S
    eng = engine(costs("separate"))
    t = run(eng, [(0.0, "a", prompt, 3), (0.0, "b", prompt, 3)])
    (_, first), *rest = t.plans
    # The idle engine waits for "a"'s tokenisation, then prefills it alone.
    assert first.api_server_s == pytest.approx(intake, abs=1e-12)
    assert set(first.num_scheduled_tokens) == {"a"}
    assert t.first_token_s["a"] == pytest.approx(intake + prefill_s(prompt), abs=1e-12)
    # "b" reached the engine at 2 x intake (after "a" on the one worker), mid-step: next step.
    assert t.finished["b"].e2e_s + 2 * intake == pytest.approx(t.now, abs=1e-12)
    assert all(p.api_server_s == 0.0 for _, p in rest)
    # Streaming ran beside the engine: "b"'s last decode step, alone, is the cost model's.
    _, last = rest[-1]
    assert set(last.num_scheduled_tokens) == {"b"}
    assert last.duration_s == pytest.approx(decode_s(prompt + 2), abs=1e-12)


def test_separate_framing_delays_a_later_prompt() -> None:
    intake = REQ_S + 100 * PROMPT_S
    end = intake + prefill_s(100)  # "a"'s first token lands: OUT_S of framing for the worker
    t = run(engine(costs("separate")), [(0.0, "a", 100, 5), (end, "b", 100, 5)])
    # "b" arrived as "a"'s first token landed: the worker framed that token, then tokenised "b".
    ready = end + OUT_S + intake
    assert t.finished_at["b"] - t.finished["b"].e2e_s == pytest.approx(ready, abs=1e-12)
    joined = next(at for at, p in t.plans if "b" in p.num_scheduled_tokens)
    assert joined >= ready
    assert all(p.api_server_s == 0.0 for _, p in t.plans[1:])  # "a" kept the engine busy


# --------------------------------------------------------------------------- aborts and gauges


@pytest.mark.parametrize("contention", ["shared", "separate"])
def test_abort_while_tokenising(contention: str) -> None:
    eng = engine(costs(contention))
    eng.add_request("a", 100, 5, 5, 0.0)
    assert eng.num_tokenising == 1
    assert eng.num_waiting == 0
    unfinished = eng.has_unfinished_requests
    assert unfinished
    stats = eng.abort_request_stats("a", 0.001)
    assert stats is not None
    assert stats.finish_reason == "abort"
    assert stats.ttft_s is None
    assert eng.num_tokenising == 0
    assert not eng.has_unfinished_requests
    assert eng.schedule(0.002) is None


def test_engine_with_costs_drains_a_random_burst_in_both_modes() -> None:
    arrivals = [(0.0005 * i, f"r{i}", 50 + 37 * i % 700, 1 + 13 * i % 60) for i in range(80)]
    for contention in ("shared", "separate"):
        t = run(engine(costs(contention)), arrivals)
        assert set(t.finished) == {rid for _, rid, _, _ in arrivals}
        assert all(f.finish_reason == "length" for f in t.finished.values())
