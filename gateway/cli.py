"""The `sluice` command line: serve, check-config, hash-key, sim (``--engine vllm|tgi|sglang``).

Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gateway.config.load import ConfigError, default_settings, load_settings
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="SLO-aware admission control and load shedding for LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway. Without --config it runs the embedded default: "
        "127.0.0.1:8080 in front of two emulated replicas it starts itself.",
    )
    serve.add_argument("--config", type=Path, help="YAML configuration file (hot-reloaded)")

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

    sim = sub.add_parser(
        "sim",
        help="run a replica emulator (vLLM, or TGI/SGLang with --engine)",
        description="Run one emulated replica (OpenAI API, SSE, /metrics) of vLLM, TGI or SGLang "
        "(--engine) in the foreground.",
        add_help=False,
    )
    sim.add_argument("args", nargs=argparse.REMAINDER, help="see `sluice sim --help`")
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


def _serve(config: Path | None) -> int:
    from gateway.app import run_gateway
    from gateway.config.reload import ConfigReloader
    from gateway.replicas.emulators import EmulatorStartError

    try:
        settings = load_settings(config) if config is not None else default_settings()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    _configure_logging(settings)
    store = SettingsStore(settings)
    if config is None:
        _print_banner(settings)
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


#: Where an emulator's bare profile name is looked up (``EmulatorSettings.profile``).
PROFILES_DIR = Path(__file__).resolve().parents[1] / "config" / "profiles"


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

    child = subprocess.Popen([sys.executable, "-m", "simulator", *args])
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, _: child.send_signal(signum))
    try:
        status = child.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)
    return 128 - status if status < 0 else status


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
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "serve":
        return _serve(args.config)
    if args.command == "hash-key":
        return _hash_key()
    if args.command == "sim":
        return _sim(args.args)
    logging.getLogger(__name__).error("unknown command %s", args.command)
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
