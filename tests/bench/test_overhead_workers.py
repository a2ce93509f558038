"""``bench.overhead --workers N``: the lines comparing ``sluice+workersN`` with ``sluice``, on
hand-built cells (the run itself is the smoke test's and the full bench's)."""

from __future__ import annotations

from bench.overhead.core import Cell, cpu_layout, workers_lines


def _cell(config: str, scenario: str, rps: float, cpu: float | None) -> Cell:
    nan = float("nan")
    return Cell(config, scenario, rps, 1.0, 2.0, nan, nan, nan, nan, cpu, None, 100, 0.0, 0.0)


def test_workers_lines_give_the_ratio_and_the_verdict_per_c32_scenario() -> None:
    cells = [
        _cell("direct", "json c=32", 9000, None),
        _cell("sluice", "json c=32", 1000, 0.98),
        _cell("sluice+workers2", "json c=32", 1800, 1.9),
        _cell("sluice", "stream c=32", 300, 0.7),
        _cell("sluice+workers2", "stream c=32", 330, 0.9),
        _cell("sluice", "json c=1", 600, 0.6),
        _cell("sluice+workers2", "json c=1", 600, 0.6),
    ]
    assert workers_lines(cells) == [
        "- workers 2 / 1 (json c=32): 1800 / 1000 req/s = 1.80x (target >= 1.7x) -> **met**; "
        "proxy CPU 1.90 vs 0.98",
        "- workers 2 / 1 (stream c=32): 330 / 300 req/s = 1.10x (target >= 1.7x) -> not met; "
        "proxy CPU 0.90 vs 0.70",
    ]
    assert workers_lines(cells[:2]) == []


def test_with_workers_nothing_is_pinned() -> None:
    proxy, load, sentence = cpu_layout(None, pin=False)
    assert (proxy, load) == (None, None)
    assert sentence.startswith("nothing pinned (--workers)")
