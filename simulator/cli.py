"""The emulator's command line: ``python -m simulator`` / ``sluice sim`` runs one emulated
replica in the foreground until SIGINT/SIGTERM.

``main`` parses the arguments (``_parser``), loads the profile and runs :func:`serve`, which
serves ``simulator.server.build_app`` and reports the bound URL once the socket listens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

from simulator import sglang, tgi
from simulator.apiserver import CONTENTION_MODES, ApiServerCosts
from simulator.profile import Profile, load_profile
from simulator.replica import ENGINES, VLLM_VERSION, EngineKind
from simulator.server import build_app

#: The emulator's one logger (``simulator.replica`` logs under the same name).
log = logging.getLogger("simulator.server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice sim",
        description="Run one emulated replica (OpenAI API, SSE, /metrics) of vLLM, TGI or SGLang in "
        "the foreground.",
    )
    parser.add_argument(
        "--profile", required=True, help="profile name (simulator/profiles/NAME.yaml) or a path"
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="engine to imitate: its /metrics, info endpoint (TGI /info, SGLang /get_server_info), "
        "native API (TGI /generate, /generate_stream) and overload behaviour (default vllm)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="TGI only: requests queued + running before a 429 "
        f"(default {tgi.DEFAULT_MAX_CONCURRENT_REQUESTS})",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--seed", type=int, default=None, help="seed for output lengths and jitter")
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="relative step-time noise, e.g. 0.05 (default 0)"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's automatic prefix caching (docs/emulator.md, 'Prefix caching'); replaces the "
        "profile's engine.enable_prefix_caching (true in the shipped profiles, as vLLM V1)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="as vLLM: usage carries prompt_tokens_details.cached_tokens (default off)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop (as on SIGTERM) once process PID is no longer this one's parent, so a killed "
        "`sluice serve` leaves no emulator holding its port (default: run until signalled)",
    )
    api = parser.add_argument_group(
        "API-server costs",
        "the API server's own work in front of the engine (docs/emulator.md); each flag replaces the "
        "profile's api_server value, which is 0 (none) in the shipped profiles",
    )
    api.add_argument(
        "--api-per-request-s", type=float, default=None, metavar="S", help="fixed work per request, seconds"
    )
    api.add_argument(
        "--api-per-prompt-token-s",
        type=float,
        default=None,
        metavar="S",
        help="tokenisation work per prompt token, seconds",
    )
    api.add_argument(
        "--api-per-output-token-s",
        type=float,
        default=None,
        metavar="S",
        help="detokenisation and framing work per streamed token, seconds",
    )
    api.add_argument(
        "--api-per-step-s",
        type=float,
        default=None,
        metavar="S",
        help="work per engine step that streamed tokens (receiving the engine's outputs), seconds",
    )
    api.add_argument(
        "--api-contention",
        choices=CONTENTION_MODES,
        default=None,
        help="'shared': the work delays the engine's steps (one CPU); 'separate': it runs beside them",
    )
    return parser


def api_server_costs(args: argparse.Namespace, profile: Profile) -> ApiServerCosts:
    """The profile's ``api_server`` costs with the ``--api-*`` flags given on the command line
    replacing theirs. ``ValueError`` for a negative cost."""
    flags = {
        "per_request_s": args.api_per_request_s,
        "per_prompt_token_s": args.api_per_prompt_token_s,
        "per_output_token_s": args.api_per_output_token_s,
        "per_step_s": args.api_per_step_s,
        "contention": args.api_contention,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    return ApiServerCosts.model_validate({**profile.api_server.model_dump(), **given})


async def serve(
    profile: Profile,
    *,
    host: str,
    port: int,
    seed: int | None = None,
    jitter: float = 0.0,
    ready: Callable[[str], None] | None = None,
    engine: EngineKind = "vllm",
    max_concurrent_requests: int | None = None,
    parent_pid: int | None = None,
    enable_prompt_tokens_details: bool = False,
) -> None:
    """Serve ``profile`` on ``host:port`` until SIGINT/SIGTERM (or cancellation), then shut down;
    with ``parent_pid``, also once that process is no longer this one's parent (it died, however).

    ``ready`` is called with the base URL once the socket listens (the port is the real one when
    ``port`` is 0).
    """
    app = build_app(
        profile,
        seed=seed,
        jitter=jitter,
        engine=engine,
        max_concurrent_requests=max_concurrent_requests,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    # handler_cancellation: a vanished client cancels its handler at once (the watcher is the
    # fallback); shutdown_timeout: streams are aborted at shutdown, so this is only a backstop.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Handlers first: whoever waits for the ready line may signal right after it.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        orphaned = None if parent_pid is None else asyncio.create_task(_orphaned(parent_pid, stop))
        try:
            bound_host, bound_port = runner.addresses[0][:2]
            if ready is not None:
                ready(f"http://{_url_host(str(bound_host))}:{bound_port}")
            await stop.wait()
        finally:
            if orphaned is not None:
                orphaned.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()


#: Seconds between checks that the parent named by ``--parent-pid`` is still the parent.
PARENT_POLL_S = 0.5


async def _orphaned(parent_pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer this process's parent (polled; a dead
    parent's children are re-parented, so ``os.getppid`` changes on every platform)."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 - nothing signals a parent's death
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent process %d is gone: stopping", parent_pid)
    stop.set()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency off Windows
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m simulator`` / ``sluice sim``: run one replica in the foreground.

    Logs one ready line (``... ready on http://HOST:PORT: ...``, the real port when ``--port 0``)
    to stderr once it accepts connections. Returns 0 after SIGINT/SIGTERM, 1 when it cannot
    listen, 2 for a profile it cannot load (argparse exits 2 on bad arguments).
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as exc:
        print(f"sluice sim: cannot load profile {args.profile!r}: {exc}", file=sys.stderr)
        return 2
    try:
        profile = profile.with_api_server(api_server_costs(args, profile))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"sluice sim: bad --api-* value: {exc}", file=sys.stderr)
        return 2

    if args.enable_prefix_caching is not None:
        profile = profile.with_engine(enable_prefix_caching=args.enable_prefix_caching)
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        print("sluice sim: --max-concurrent-requests must be >= 1", file=sys.stderr)
        return 2
    engine: EngineKind = args.engine
    what = {
        "vllm": f"vLLM {VLLM_VERSION}",
        "tgi": f"TGI {tgi.TGI_VERSION}",
        "sglang": f"SGLang {sglang.SGLANG_VERSION}",
    }

    def ready(url: str) -> None:
        log.info(
            "replica emulator ready on %s: model %s, profile %s, %s API",
            url,
            profile.served_model_name,
            profile.name,
            what[engine],
        )
        if profile.api_server.enabled:
            costs = profile.api_server
            log.info(
                "API-server costs: %g s per request, %g s per prompt token, %g s per streamed token, "
                "%g s per step, %s CPU",
                costs.per_request_s,
                costs.per_prompt_token_s,
                costs.per_output_token_s,
                costs.per_step_s,
                costs.contention,
            )

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(
                serve(
                    profile,
                    host=args.host,
                    port=args.port,
                    seed=args.seed,
                    jitter=args.jitter,
                    ready=ready,
                    engine=engine,
                    max_concurrent_requests=args.max_concurrent_requests,
                    parent_pid=args.parent_pid,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                )
            )
    except OSError as exc:
        print(f"sluice sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    log.info("replica emulator stopped")
    return 0
