"""The `sluice` command line: serve, config show|init, check-config, hash-key, keys
issue|list|revoke (``gateway.tenants.keys_cli``), sim (``--engine vllm|tgi|sglang``), plan
(capacity planning: ``python -m planner``) and ``--version``.

What ``serve`` and ``config`` run is one of: a file (``--config``), replicas named by URL
(``--replica``, each asked what it runs: ``gateway.replicas.discover``) or the embedded default.
Each option has an environment variable for containers (``ENV``); an option given on the
command line wins over its variable.

Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gateway.config.load import ConfigError, load_settings
from gateway.config.settings import Settings
from gateway.config.starter import (
    COMMAND_LINE,
    ENV,
    Source,
    UsageError,
    load_source,
    resolve_source,
    with_workers,
)
from gateway.config.store import SettingsStore
from gateway.tenants.keys_cli import add_keys_parser, run_keys
from gateway.version import package_version

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2

log = logging.getLogger("sluice.cli")


def _add_source_options(parser: argparse.ArgumentParser, *, serve: bool) -> None:
    group = parser.add_argument_group(
        "what to run (default: the embedded default, 127.0.0.1:8080 in front of two emulated replicas)"
    )
    reload_note = " (hot-reloaded)" if serve else ""
    group.add_argument(
        "--config", type=Path, metavar="FILE", help=f"YAML configuration file{reload_note} [{ENV['config']}]"
    )
    group.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="base URL of a running replica (vLLM, TGI, SGLang), e.g. http://10.0.0.5:8000; repeat for "
        "each. Its engine, models and exposed hardware are asked from it; every other key takes its "
        f"default [{ENV['replica']}: URLs separated by commas]",
    )
    group.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"with --replica: where the gateway listens (default 127.0.0.1:8080) [{ENV['listen']}]",
    )
    group.add_argument(
        "--demo-tenant",
        action="store_true",
        default=None,
        help="with --replica: add the demo tenant (API key sk-demo); without it no tenant is configured "
        f"and every request is served [{ENV['demo_tenant']}=1]",
    )
    group.add_argument(
        "--replica-api-key-env",
        metavar="NAME",
        help="with --replica: the environment variable holding the API key the replicas were started "
        f"with (vLLM's --api-key), sent on every request to them [{ENV['replica_api_key_env']}]",
    )
    group.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="with --replica and no tenant: allow listening beyond loopback "
        f"(server.allow_unauthenticated) [{ENV['allow_unauthenticated']}=1]",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but ``sim``'s own options (``main`` hands those over)."""
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="SLO-aware admission control and load shedding for LLM inference.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"sluice {package_version()}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway: from a file (--config), in front of running replicas given by URL "
        "(--replica), or the embedded default: 127.0.0.1:8080 in front of two emulated replicas it "
        "starts itself.",
    )
    _add_source_options(serve, serve=True)
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="gateway processes on the one port (SO_REUSEPORT) under a supervisor; replaces "
        f"server.workers (docs/deployment.md, Workers) [{ENV['workers']}]",
    )

    config = sub.add_parser(
        "config",
        help="print the effective configuration, or a starter YAML to edit",
        description="Print the configuration `sluice serve` would run with the same options.",
    )
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="every key with its value",
        description="Print every key of the effective configuration with its value, as YAML that "
        "`sluice serve --config` accepts.",
    )
    _add_source_options(show, serve=False)
    init = config_sub.add_parser(
        "init",
        help="a starter YAML: only what differs from the defaults",
        description="Print a starter configuration (the keys that differ from their defaults, with "
        "what each replica said about itself) to edit and run with `sluice serve --config FILE`, "
        "e.g. `sluice config init --replica http://10.0.0.5:8000 > sluice.yaml`.",
    )
    _add_source_options(init, serve=False)
    init.add_argument("--write", type=Path, metavar="PATH", help="write it to PATH instead of stdout")
    init.add_argument("--force", action="store_true", help="with --write: replace an existing file")

    check = sub.add_parser(
        "check-config",
        help="validate a configuration file offline",
        description="Validate FILE exactly as `serve` would; print every problem; exit 2 on error.",
    )
    check.add_argument("file", type=Path)

    sub.add_parser(
        "hash-key",
        help="print the hash of an API key or the admin token (read from stdin)",
        description="Read one API key from stdin (a prompt that does not echo when stdin is a "
        "terminal; surrounding whitespace and the trailing newline are dropped) and print the "
        "sha256:<hex> hash that api_keys, the keys file and admin.token_sha256 hold. The key "
        "itself is never printed.",
    )

    add_keys_parser(sub)

    sim = sub.add_parser(
        "sim",
        help="run a replica emulator (vLLM, or TGI/SGLang with --engine)",
        description="Run one emulated replica (OpenAI API, SSE, /metrics) of vLLM, TGI or SGLang "
        "(--engine) in the foreground.",
        add_help=False,
    )
    sim.add_argument("args", nargs=argparse.REMAINDER, help="see `sluice sim --help`")

    plan = sub.add_parser(
        "plan",
        help="capacity planning: replicas for the targets, KV check, cost",
        description="Replay a workload in virtual time through the admission engine and the emulator "
        "to find the replicas its classes' targets need, with closed-form checks (planner/).",
        add_help=False,
    )
    plan.add_argument("args", nargs=argparse.REMAINDER, help="see `sluice plan --help`")
    return parser


def _configure_logging(settings: Settings) -> None:
    from gateway.observability.logs import configure_logging

    configure_logging(settings.logging)


def _check_config(path: Path) -> int:
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    replicas = settings.all_replicas()
    print(f"{path}: OK ({len(replicas)} replica(s): {', '.join(r.name for r in replicas)})")
    return EXIT_OK


def _hash_key() -> int:
    """``sluice hash-key``: the stored form of the key on stdin; exit 2 for an unusable key."""
    import getpass

    from gateway.tenants import hash_api_key

    key = getpass.getpass("API key (not echoed): ") if sys.stdin.isatty() else sys.stdin.read()
    try:
        print(hash_api_key(key.strip()))
    except ValueError as exc:
        print(f"sluice hash-key: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


def _serve(source: Source, argv: list[str]) -> int:
    """``sluice serve``: one gateway, or (``server.workers`` > 1) the supervisor of that many,
    each started with ``argv`` (``gateway.workers``)."""
    from gateway.config.reload import ConfigReloader
    from gateway.replicas.emulators import EmulatorStartError
    from gateway.serve import run_gateway
    from gateway.workers import worker_index

    worker = worker_index()
    try:
        settings, discovered = load_source(source)
        if worker is None:  # a worker runs as one gateway, whatever its file says
            settings = with_workers(settings, source.workers, str(source.config or COMMAND_LINE))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    if worker is None and settings.server.workers > 1:
        return _supervise(settings, source, argv)
    _configure_logging(settings)
    store = SettingsStore(settings)
    for name, found in discovered:
        log.info("replica %s (%s): %s", name, found.url, found.describe())
    if settings.authenticates_no_one:
        log.warning(
            "no tenant is configured: Sluice authenticates no one and serves every request on "
            "http://%s:%d whatever key it carries (docs/tenants.md adds tenants and API keys)",
            settings.server.host,
            settings.server.port,
        )
    if source.config is None and not source.replicas and worker is None:
        _print_banner(settings)
    config = source.config
    try:
        if config is None:
            run_gateway(store)
        else:
            run_gateway(store, reloader_factory=lambda s, r: ConfigReloader(config, s, on_result=r))
    except EmulatorStartError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:  # a listener could not bind (port in use, permission)
        where = f"{settings.server.host}:{settings.server.port}"
        if settings.admin.port is not None:
            where += f" (admin listener {settings.admin.host}:{settings.admin.port})"
        print(f"sluice: cannot serve on {where}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _supervise(settings: Settings, source: Source, argv: list[str]) -> int:
    """``sluice serve`` with ``server.workers`` > 1: the supervisor (``gateway.workers.supervisor``)."""
    from gateway.replicas.emulators import EmulatorStartError
    from gateway.workers.supervisor import supervise

    _configure_logging(settings)
    if source.config is None and not source.replicas:
        _print_banner(settings)
    if not settings.ledger.enabled:
        log.warning(
            "server.workers: %d without ledger.enabled: each worker admits with its own requests "
            "plus the replicas' scrapes, so in a burst the workers together may admit up to %d "
            "times a replica's headroom within one scrape interval; ledger.enabled (on limits.redis) "
            "shares their in-flight requests (docs/deployment.md, Workers)",
            settings.server.workers,
            settings.server.workers,
        )
    limited = settings.limited_tenants()
    if settings.limits.backend == "memory" and limited:
        log.warning(
            "server.workers: %d with limits.backend: memory: each worker keeps 1/%d of every tenant "
            "budget (%s ...), so a tenant's total stays within its limits, but one whose connections "
            "land unevenly on the workers may be refused before it used them all; limits.backend: "
            "redis keeps one budget for every worker (docs/deployment.md, Workers)",
            settings.server.workers,
            settings.server.workers,
            limited[0],
        )
    try:
        return supervise(settings, argv, settings.server.workers)
    except EmulatorStartError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        where = f"{settings.server.host}:{settings.server.port}"
        print(f"sluice: cannot serve on {where}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _config(action: str, source: Source, write: Path | None, force: bool) -> int:
    """``sluice config show|init``: the configuration ``serve`` would run, as YAML."""
    from gateway.config.starter import effective_yaml, starter_yaml

    if write is not None and write.exists() and not force:
        print(
            f"sluice config init: {write} exists; remove it, choose another path or add --force",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        settings, discovered = load_source(source)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    for name, found in discovered:
        if found.error is not None:
            print(f"sluice config: replica {name} ({found.url}): {found.describe()}", file=sys.stderr)
    if action == "show":
        text = effective_yaml(settings)
    else:
        notes = [f"Replica {name} ({found.url}): {found.describe()}." for name, found in discovered]
        if discovered:
            notes.append(
                "GPU kinds are not exposed by the engines: write replicas[].hardware.gpu (and vLLM's "
                "--max-num-seqs, --max-num-batched-tokens) for a roofline prior from the first request."
            )
        text = starter_yaml(settings, notes)
    if write is None:
        sys.stdout.write(text)
    else:
        write.write_text(text, encoding="utf-8")
        print(f"sluice config init: wrote {write}", file=sys.stderr)
    return EXIT_OK


#: Where an emulator's bare profile name is looked up (``EmulatorSettings.profile``): the
#: ``simulator`` package's data, beside this package in a checkout and once installed alike.
PROFILES_DIR = Path(__file__).resolve().parents[1] / "simulator" / "profiles"


def _served_model_name(settings: Settings) -> str:
    """The model the first emulator serves, for the examples (the gateway lists it at /v1/models):
    its profile file's ``served_model_name``, read as data (the gateway does not import the
    emulator); ``<model>`` when there is no emulator or the file cannot be read."""
    import yaml

    try:
        profile = settings.emulators[0].profile
        bare = not profile.endswith((".yaml", ".yml")) and "/" not in profile
        path = PROFILES_DIR / f"{profile}.yaml" if bare else Path(profile)
        model = yaml.safe_load(path.read_text(encoding="utf-8"))["served_model_name"]
    except (IndexError, OSError, yaml.YAMLError, KeyError, TypeError):
        return "<model>"
    return str(model)


def _sim(args: list[str]) -> int:
    """``sluice sim ARGS``: the emulator as a child process (``python -m simulator ARGS``, as
    ``sluice serve`` starts its emulators); returns its exit status (128 + N if signal N ended it).

    The child shares the terminal's process group, so a Ctrl-C reaches it directly and it shuts
    down itself: the parent ignores SIGINT meanwhile and passes SIGTERM on.
    """
    import signal
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "simulator", *args, "--parent-pid", str(os.getpid())])
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, _: child.send_signal(signum))
    try:
        status = child.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)
    return 128 - status if status < 0 else status


def _plan(args: list[str]) -> int:
    """``sluice plan ARGS``: ``python -m planner ARGS`` as a child process (the planner drives
    ``replay``, which the gateway never imports); returns its exit status."""
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-m", "planner", *args], check=False)
    except KeyboardInterrupt:
        return 130
    return 128 - done.returncode if done.returncode < 0 else done.returncode


def _print_banner(settings: Settings) -> None:
    """The ready-to-paste examples for the embedded default (its demo tenant's key, ``sk-demo``)."""
    from gateway.tenants import DEMO_API_KEY

    base = f"http://{settings.server.host}:{settings.server.port}"
    key = DEMO_API_KEY
    model = _served_model_name(settings)
    emulators = ", ".join(f"{e.name} ({e.profile}, port {e.port})" for e in settings.emulators)
    print(
        f"""
Sluice: gateway on {base} in front of emulated replicas: {emulators}.
Ctrl-C stops the gateway and the replicas it started.
The demo tenant's API key is {key} (config/demo.yaml; docs/tenants.md for your own tenants).

Try it:

  curl -sN {base}/v1/chat/completions \\
    -H 'Authorization: Bearer {key}' -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{base}/v1", api_key="{key}")
r = c.chat.completions.create(model="{model}", max_tokens=32,
    messages=[{{"role": "user", "content": "Hello!"}}])
print(r.choices[0].message.content, r.usage)'
""",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sluice` console script; returns the process exit code."""
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["sim"]:
        # Everything after `sim` is the emulator's own command line: argparse's REMAINDER would
        # refuse the options (`--profile ...`) that come before any positional.
        return _sim(raw[1:])
    if raw[:1] == ["plan"]:
        return _plan(raw[1:])
    args = build_parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command in ("serve", "config"):
        try:
            source = resolve_source(args, os.environ)
        except UsageError as exc:
            print(f"sluice {args.command}: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        if args.command == "serve":
            return _serve(source, raw)
        return _config(
            args.config_command, source, getattr(args, "write", None), getattr(args, "force", False)
        )
    if args.command == "hash-key":
        return _hash_key()
    if args.command == "keys":
        return run_keys(args)
    if args.command == "sim":
        return _sim(args.args)
    if args.command == "plan":
        return _plan(args.args)
    logging.getLogger(__name__).error("unknown command %s", args.command)
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
