"""``python -m bench.closed_loop``: the command line of the closed-loop bench (``core``)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.closed_loop.core import FULL, QUICK, render, run, write_json
from bench.closed_loop.workload import TRACES
from bench.e2e.core import measured_command
from bench.shared import parse_variant
from tests.e2e.vllm_cpu import Unavailable


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; print its tables and verdicts. 0 when it ran (whatever the verdicts), 2
    when the real vLLM cannot run here, 130 when stopped."""
    parser = argparse.ArgumentParser(prog="python -m bench.closed_loop", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="CI configuration: the Azure trace, 0.5x and 2x, 20 s each"
    )
    parser.add_argument("--traces", nargs="+", choices=sorted(TRACES), help="traces to replay")
    parser.add_argument("--loads", type=float, nargs="+", help="multiples of the direct capacity")
    parser.add_argument("--duration", type=float, help="seconds of sending per point")
    parser.add_argument("--ttft-target", type=float, help="the class's TTFT target, seconds (2)")
    parser.add_argument("--tpot-target", type=float, help="the class's TPOT target, seconds (0.15)")
    parser.add_argument("--json", type=Path, help="write the report (every request included) as JSON here")
    parser.add_argument(
        "--work", type=Path, help="keep the logs, configs and report.md here (default: a temporary folder)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="also run Sluice with these settings merged into its configuration, path `sluice+LABEL`, "
        """e.g. 'overdue={"admission": {"overdue_ttft": true}}' (repeatable)""",
    )
    args = parser.parse_args(argv)
    variants = []
    for spec in args.variant:
        try:
            variants.append(parse_variant(spec))
        except ValueError as exc:
            parser.error(str(exc))

    plan = QUICK if args.quick else FULL
    changes = {
        "traces": tuple(args.traces) if args.traces else None,
        "loads": tuple(args.loads) if args.loads else None,
        "duration_s": args.duration,
        "ttft_target_s": args.ttft_target,
        "tpot_target_s": args.tpot_target,
        "variants": tuple(variants) or None,
    }
    plan = replace(plan, **{k: v for k, v in changes.items() if v is not None})
    command = measured_command(list(argv) if argv is not None else sys.argv[1:])
    command = command.replace("python -m bench.e2e", "python -m bench.closed_loop", 1)
    # SIGTERM ends the run through the same clean-up as an error: vLLM and Sluice are stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        report = run(plan, command, args.work, log=lambda line: print(line, flush=True))
    except (Unavailable, TimeoutError) as exc:
        print(f"bench/closed_loop: cannot run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(
            f"bench/closed_loop: stopped by {exc or 'SIGINT'}; vLLM and Sluice are stopped", file=sys.stderr
        )
        return 130
    text = render(report)
    print()
    print(text)
    if args.work:
        (args.work / "report.md").write_text(text + "\n", encoding="utf-8")
    if args.json:
        write_json(report, args.json)
    return 0
