"""A configuration from the command line alone, and configurations as YAML.

``command_line_settings`` is what ``sluice serve --replica URL ...`` runs: the given replicas
(their entries built by the caller, from ``gateway.replicas.discover``), the listener, and
no tenant unless the demo one is asked for. It is validated by ``parse_settings`` like a file, so
a problem is the same ``ConfigError`` line a file would give (its source is
``COMMAND_LINE``).

``resolve_source`` reads what the command line and the environment name (a file, replicas by
URL, or the embedded default) and ``load_source`` turns it into ``Settings``, asking each replica
given by URL what it runs first.

``effective_yaml`` prints every key of a configuration with its value (``sluice config show``);
``starter_yaml`` only what differs from the defaults, under a header saying how to use it
(``sluice config init``). Both load back, through ``load_settings``, to the same ``Settings``.
"""

from __future__ import annotations

import argparse
import asyncio
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from gateway.config.load import ConfigError, default_settings, load_settings, parse_settings
from gateway.config.settings import Settings
from gateway.tenants import demo_tenants

if TYPE_CHECKING:
    from gateway.replicas.discover import Discovered

__all__ = [
    "COMMAND_LINE",
    "DEFAULT_LISTEN",
    "ENV",
    "Source",
    "UsageError",
    "command_line_settings",
    "effective_yaml",
    "load_source",
    "parse_listen",
    "resolve_source",
    "starter_yaml",
    "with_workers",
]

#: How errors name a configuration built from the command line.
COMMAND_LINE: Final = "command line"
#: Where ``sluice serve --replica`` listens unless told otherwise.
DEFAULT_LISTEN: Final = ("127.0.0.1", 8080)


#: The environment variable of each option of ``serve`` and ``config`` (``SLUICE_REPLICAS``:
#: URLs separated by commas or spaces; the two switches: 1/true/yes/on or 0/false/no/off).
ENV: Final = {
    "config": "SLUICE_CONFIG",
    "replica": "SLUICE_REPLICAS",
    "listen": "SLUICE_LISTEN",
    "demo_tenant": "SLUICE_DEMO_TENANT",
    "allow_unauthenticated": "SLUICE_ALLOW_UNAUTHENTICATED",
    "replica_api_key_env": "SLUICE_REPLICA_API_KEY_ENV",
    "workers": "SLUICE_WORKERS",
}
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})


class UsageError(Exception):
    """Options that do not go together (exit 2); the message is one line for stderr."""


@dataclass(frozen=True)
class Source:
    """What ``serve`` and ``config`` run: a file, replicas by URL (with the listener and the two
    switches that go with them), or neither (the embedded default)."""

    config: Path | None = None
    replicas: tuple[str, ...] = ()
    listen: str | None = None
    demo_tenant: bool = False
    allow_unauthenticated: bool = False
    #: The environment variable holding the key the replicas were started with (``--api-key``).
    replica_api_key_env: str | None = None
    #: ``serve --workers N``: replaces ``server.workers``; ``None`` keeps the configuration's.
    workers: int | None = None


def _switch(flag: bool | None, env: Mapping[str, str], name: str) -> bool:
    if flag:
        return True
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise UsageError(f"{name}={raw!r}: expected 1, true, yes, on or 0, false, no, off")


def _workers(flag: int | None, env: Mapping[str, str]) -> int | None:
    if flag is not None:
        return flag
    raw = env.get(ENV["workers"], "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise UsageError(f"{ENV['workers']}={raw!r}: expected a whole number of worker processes")
    return int(raw)


def with_workers(settings: Settings, workers: int | None, source: str) -> Settings:
    """``settings`` with ``server.workers`` set to ``workers`` (``sluice serve --workers N``),
    validated again (``ConfigError`` naming ``source``); ``settings`` itself when ``workers`` is None."""
    if workers is None or workers == settings.server.workers:
        return settings
    data = settings.model_dump()
    data["server"] = {**data["server"], "workers": workers}
    return parse_settings(data, f"{source} with --workers {workers}")


def resolve_source(args: argparse.Namespace, env: Mapping[str, str]) -> Source:
    """The ``Source`` the parsed options and the environment ``env`` name; ``UsageError`` when
    they name both a file and replicas, or give a replica-only option without replicas."""
    config_text = str(args.config) if args.config is not None else env.get(ENV["config"], "").strip()
    replicas = args.replica or env.get(ENV["replica"], "").replace(",", " ").split()
    source = Source(
        config=Path(config_text) if config_text else None,
        replicas=tuple(replicas),
        listen=args.listen if args.listen is not None else (env.get(ENV["listen"], "").strip() or None),
        demo_tenant=_switch(args.demo_tenant, env, ENV["demo_tenant"]),
        allow_unauthenticated=_switch(args.allow_unauthenticated, env, ENV["allow_unauthenticated"]),
        replica_api_key_env=args.replica_api_key_env
        or env.get(ENV["replica_api_key_env"], "").strip()
        or None,
        workers=_workers(getattr(args, "workers", None), env),
    )
    if source.config is not None and source.replicas:
        raise UsageError(
            f"give either --config ({ENV['config']}) or --replica ({ENV['replica']}), not both: "
            "list the replicas in the file"
        )
    if not source.replicas:
        extra = [
            flag
            for flag, given in (
                ("--listen", source.listen is not None),
                ("--demo-tenant", source.demo_tenant),
                ("--allow-unauthenticated", source.allow_unauthenticated),
                ("--replica-api-key-env", source.replica_api_key_env is not None),
            )
            if given
        ]
        if extra:
            where = "set server.host, server.port, tenants, server.allow_unauthenticated and "
            where += "replicas[].api_key_env in the file"
            raise UsageError(f"{', '.join(extra)}: only with --replica (with --config, {where})")
    return source


def load_source(source: Source) -> tuple[Settings, list[tuple[str, Discovered]]]:
    """The settings ``source`` names, and each replica given by URL with what it said (empty for
    a file or the embedded default). The options are validated before any replica is asked.
    Raises ``ConfigError``."""
    if source.config is not None:
        return load_settings(source.config), []
    if not source.replicas:
        return default_settings(), []
    from gateway.replicas.discover import discover_all, replica_names

    try:
        listen = parse_listen(source.listen) if source.listen is not None else None
    except ValueError as exc:
        raise ConfigError(COMMAND_LINE, [f"--listen: {exc}"]) from None
    names = replica_names(source.replicas)

    def build(entries: list[dict[str, Any]]) -> Settings:
        return command_line_settings(
            entries,
            listen=listen,
            demo_tenant=source.demo_tenant,
            allow_unauthenticated=source.allow_unauthenticated,
        )

    key = {"api_key_env": source.replica_api_key_env} if source.replica_api_key_env else {}
    bare = [
        {"name": n, "url": u, "backend": "auto", **key} for n, u in zip(names, source.replicas, strict=True)
    ]
    asked = build(bare)  # every problem of the options, before any request
    discovered = asyncio.run(discover_all(asked))
    entries = [d.settings().model_dump(mode="json", exclude_defaults=True) for d in discovered]
    return build(entries), list(zip(names, discovered, strict=True))


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT``, ``:PORT`` (host 127.0.0.1) or ``HOST`` (port 8080) as
    ``(host, port)``; ``ValueError`` with a one-line reason otherwise. Ranges are left to the
    settings (``server.port``)."""
    text = text.strip()
    if text.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a host alone, or a bare IPv6 address
        host, port_text = text, ""
    host = host or DEFAULT_LISTEN[0]
    if not port_text:
        return host, DEFAULT_LISTEN[1]
    if not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT with a numeric port, got {text!r}")
    return host, int(port_text)


def command_line_settings(
    replicas: Sequence[Mapping[str, Any]],
    *,
    listen: tuple[str, int] | None = None,
    demo_tenant: bool = False,
    allow_unauthenticated: bool = False,
) -> Settings:
    """The configuration of ``sluice serve --replica ...``: ``replicas`` (its entries as in YAML),
    every other key at its default.

    ``demo_tenant``: add the embedded default's ``demo`` tenant (key ``sk-demo``); otherwise no
    tenant is configured and keys are not looked at, which ``Settings`` allows beyond loopback
    only with ``allow_unauthenticated``. Raises ``ConfigError`` (source ``COMMAND_LINE``).
    """
    host, port = listen or DEFAULT_LISTEN
    server: dict[str, Any] = {"host": host, "port": port}
    if allow_unauthenticated:
        server["allow_unauthenticated"] = True
    data: dict[str, Any] = {
        "server": server,
        "replicas": [dict(entry) for entry in replicas],
    }
    if demo_tenant:
        data["tenants"] = demo_tenants().model_dump(mode="json", exclude_defaults=True)
    return parse_settings(data, COMMAND_LINE)


def effective_yaml(settings: Settings) -> str:
    """Every key of ``settings`` with its value, in the settings models' order. The keys a
    ``tenants.keys_file`` added are shown in their tenants' ``api_keys`` and ``keys_file`` is left
    out, so the text loads back to the same settings."""
    return _dump(_plain(settings, exclude_defaults=False))


def starter_yaml(settings: Settings, notes: Sequence[str] = ()) -> str:
    """The keys of ``settings`` that differ from their defaults (the keys file's keys inline, as
    ``effective_yaml``), under a header on how to use the file; ``notes`` are added to the header
    as comment lines (e.g. what each replica said)."""
    header = [
        "Sluice configuration: only the keys that differ from their defaults.",
        "Check it with `sluice check-config FILE`; run it with `sluice serve --config FILE` (edits are",
        "hot-reloaded). Every key, its unit and default: config/sluice.example.yaml. Tenants and",
        "their API keys (stored as hashes: `sluice hash-key`): docs/tenants.md.",
    ]
    if settings.authenticates_no_one:
        header.append("No tenant is configured: every request is served, whatever key it carries.")
    header += list(notes)
    lines = [
        line
        for text in header
        for line in textwrap.wrap(text, width=96, subsequent_indent="  ", break_on_hyphens=False)
    ]
    comments = "".join(f"# {line}\n" for line in lines)
    return comments + "\n" + _dump(_plain(settings, exclude_defaults=True))


def _plain(settings: Settings, *, exclude_defaults: bool) -> dict[str, Any]:
    data = settings.model_dump(mode="json", exclude_defaults=exclude_defaults)
    if settings.tenants.keys_file is not None:  # its keys are in api_keys already
        del data["tenants"]["keys_file"]
    return data


def _dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
