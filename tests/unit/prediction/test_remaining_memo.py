"""``PredictionService.replica_inputs`` keeps the expected remaining output of the requests in
flight between view rebuilds (a memo cleared by ``on_finished``): the state it builds must equal
what a fresh service, taught the same output lengths, builds for the same requests.

Each case is a sequence of steps under a fake clock: either ``on_finished`` lengths (teaching the
output-length predictor) or an in-flight list to build a state for, with few requests (the
one-by-one lookups) and many (the vectorised one), streams that moved on and streams that did not.
"""

from __future__ import annotations

import pytest

from gateway.prediction.service import PredictionService
from gateway.replicas.snapshot import InFlight
from predictor import ReplicaState

Step = tuple[str, object]


def _decoding(n: int, generated: int, cap: int | None = 1000) -> list[InFlight]:
    return [InFlight(f"d{i}-{generated}", 800, generated + i, 0.0, cap, 1.0) for i in range(n)]


def _teach(service: PredictionService, lengths: list[int]) -> None:
    for n in lengths:
        service.on_finished(
            replica="r", model="m", tenant=None, prompt_chars=None, prompt_tokens=None, completion_tokens=n
        )


def _state(service: PredictionService, in_flight: list[InFlight], now: float) -> ReplicaState:
    return service.replica_inputs("r", model="m", tenant=None, in_flight=in_flight, now=now)[1]


CASES: list[tuple[str, list[Step]]] = [
    (
        "few-unchanged",
        [("build", _decoding(3, 10)), ("build", _decoding(3, 10)), ("build", _decoding(3, 10))],
    ),
    ("few-moving", [("build", _decoding(4, 10)), ("build", _decoding(4, 11)), ("build", _decoding(4, 10))]),
    (
        "taught-between-builds",
        [
            ("build", _decoding(4, 10)),
            ("teach", [50] * 30),
            ("build", _decoding(4, 10)),
            ("teach", [900] * 40),
            ("build", _decoding(4, 10)),
        ],
    ),
    (
        "many-vectorised",
        [
            ("teach", [100, 200, 300, 400] * 10),
            ("build", _decoding(40, 5) + _decoding(20, 150, None)),
            ("build", _decoding(40, 5) + _decoding(20, 151, None)),
            ("teach", [1000] * 25),
            ("build", _decoding(40, 5) + _decoding(20, 151, None)),
        ],
    ),
    (
        "uncapped-and-capped",
        [("build", _decoding(2, 3, None) + _decoding(2, 3, 8)), ("build", _decoding(2, 3, 8))],
    ),
]


@pytest.mark.parametrize("steps", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_memoised_states_equal_fresh_ones(steps: list[Step]) -> None:
    warm = PredictionService()
    taught: list[int] = []
    now = 100.0
    for kind, arg in steps:
        now += 0.002
        if kind == "teach":
            assert isinstance(arg, list)
            _teach(warm, arg)
            taught += arg
            continue
        assert isinstance(arg, list)
        fresh = PredictionService()
        _teach(fresh, taught)
        assert _state(warm, arg, now) == _state(fresh, arg, now)
