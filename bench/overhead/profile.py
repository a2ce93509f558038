"""Where a gateway process spends its CPU under the bench's load: py-spy samples, summarised.

``record(pid, seconds, out)`` runs ``py-spy record --format raw --function --gil`` on the
process: only the thread holding the GIL is sampled, so the samples are the Python process's
busy time (the event loop waiting in ``epoll`` and idle worker threads release the GIL and are
left out; without ``--gil`` py-spy counted the idle thread-pool workers as busy). ``summarise``
turns the collapsed stacks into shares of the samples:

* **self**: the function on top of the stack (where the CPU was);
* **inclusive**: every function on the stack (what it and its callees cost), counted once per
  sample;
* **by package**: the self samples grouped by where the code lives (``gateway/proxy/forward.py`` for
  Sluice's own files, the top-level package for libraries: ``aiohttp``, ``redis``, ``json``...).

Shares are fractions (0-1) of all the process's samples.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


PY_SPY_VERSION = "0.4.3"


def py_spy() -> str:
    """py-spy from the bench's own ignored venv (``.cache/bench/overhead/tools``), installed from
    PyPI on first use; raises ``peers.Unavailable`` when that fails."""
    from bench.overhead.peers import install_venv

    return str(install_venv("tools", [f"py-spy=={PY_SPY_VERSION}"], "py-spy", PY_SPY_VERSION) / "py-spy")


def record(
    pid: int, seconds: float, out: Path, cpus: str | None, rate_hz: int = 250
) -> subprocess.Popen[bytes]:
    """Start py-spy on ``pid`` for ``seconds`` (pinned to ``cpus``), raw collapsed stacks to ``out``."""
    binary = py_spy()
    args = [
        binary,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(seconds))),
        "--rate",
        str(rate_hz),
    ]
    args += ["--format", "raw", "--function", "--gil", "--output", str(out)]
    if cpus:
        args = ["taskset", "-c", cpus, *args]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def short_file(path: str) -> str:
    """``.../site-packages/aiohttp/web_protocol.py`` -> ``aiohttp/web_protocol.py``; repo files
    relative to the repository; the standard library as ``stdlib/<file>``."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    root = str(Path(__file__).resolve().parents[2]) + "/"
    if path.startswith(root):
        return path[len(root) :]
    match = re.search(r"/lib/python3\.\d+/(.*)$", path)
    if match:
        return "stdlib/" + match.group(1)
    return path


def package_of(file: str) -> str:
    """What ``by package`` groups a file under: Sluice's own files whole, libraries by top package."""
    if file.startswith(("gateway/", "predictor/")):
        return file
    if file.startswith("stdlib/"):
        rest = file.removeprefix("stdlib/")
        return "stdlib/" + rest.split("/", 1)[0].removesuffix(".py")
    return file.split("/", 1)[0].removesuffix(".py")


@dataclass(frozen=True)
class Cost:
    """One function's (or package's) share of the samples (0-1); for self costs, also the Sluice
    function nearest below it on the stack that most often called it, and that caller's part of
    its samples (0-1)."""

    name: str
    share: float
    caller: str | None = None
    caller_part: float | None = None


@dataclass(frozen=True)
class Profile:
    samples: int
    top_self: list[Cost]
    top_inclusive: list[Cost]
    by_package: list[Cost]
    #: Each sample charged to the deepest Sluice function on its stack (that function's own
    #: code and the library calls it makes directly); samples with no Sluice frame (the HTTP
    #: server and client machinery around the handlers, the loop) by their top package.
    by_sluice_frame: list[Cost]


def _frame_key(frame: str) -> tuple[str, str]:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip(), "?"
    return match.group("func"), short_file(match.group("file"))


def summarise(raw: str, top: int = 20) -> Profile:
    """The collapsed stacks ``raw`` (one ``f1;f2;...;fn count`` line each) summarised."""
    self_count: Counter[str] = Counter()
    incl_count: Counter[str] = Counter()
    by_package: Counter[str] = Counter()
    callers: dict[str, Counter[str]] = {}
    nearest: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        keys = [_frame_key(f) for f in frames]
        func, file = keys[-1]
        leaf = f"{func} ({file})"
        self_count[leaf] += count
        by_package[package_of(file)] += count
        for name in {f"{k_func} ({k_file})" for k_func, k_file in keys}:
            incl_count[name] += count
        own = next((f"{f} ({p})" for f, p in reversed(keys[:-1]) if _is_sluice(p)), None)
        if own is not None and not _is_sluice(file):
            callers.setdefault(leaf, Counter())[own] += count
        deepest = leaf if _is_sluice(file) else own
        if deepest is None or deepest.endswith(ROOT_CHAIN):
            deepest = f"(no Sluice frame) {package_of(file)}"
        nearest[deepest] += count

    def shares(counter: Counter[str], n: int) -> list[Cost]:
        return [Cost(name, c / total) for name, c in counter.most_common(n)] if total else []

    def with_callers(costs: list[Cost]) -> list[Cost]:
        out = []
        for cost in costs:
            seen = callers.get(cost.name)
            if seen:
                caller, n = seen.most_common(1)[0]
                cost = Cost(cost.name, cost.share, caller, n / self_count[cost.name])
            out.append(cost)
        return out

    # The root chain (the CLI and the loop runner) is on every stack: left out of "inclusive".
    inclusive = Counter({k: v for k, v in incl_count.items() if not k.endswith(ROOT_CHAIN)})
    return Profile(
        total,
        with_callers(shares(self_count, top)),
        shares(inclusive, top * 3),
        shares(by_package, top),
        shares(nearest, top * 2),
    )


#: Frames on every stack of ``sluice serve``: they say nothing about the request path.
ROOT_CHAIN = ("(gateway/cli.py)", "run_gateway (gateway/serve.py)", "(stdlib/runpy.py)")


def _is_sluice(file: str) -> bool:
    return file.startswith(("gateway/", "predictor/"))
