"""``sluice keys issue|list|revoke``: manage tenants' API keys through a running gateway's admin API.

The command talks to the admin API (``POST/GET/DELETE /sluice/v1/tenants/{id}/keys``), so a
change is made where the gateway keeps keys (Redis or the keys file) and applies without a
restart. Where: ``--url`` or ``SLUICE_ADMIN_URL`` (default ``http://127.0.0.1:8080``, the
gateway's own address when ``admin.port`` is unset); the admin token, when one is configured,
from ``SLUICE_ADMIN_TOKEN`` only (an argument would show in ``ps`` and shell history).
``issue`` prints the secret alone on stdout (``KEY=$(sluice keys issue --tenant team-a)``), once;
what it is goes to stderr. Exit codes: 0 done, 1 the gateway refused or could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Final

__all__ = ["DEFAULT_ADMIN_URL", "add_keys_parser", "run_keys"]

DEFAULT_ADMIN_URL: Final = "http://127.0.0.1:8080"
URL_ENV: Final = "SLUICE_ADMIN_URL"
TOKEN_ENV: Final = "SLUICE_ADMIN_TOKEN"
TIMEOUT_S: Final = 10.0


class KeysCommandError(Exception):
    """What went wrong, as the one line the command prints."""


def add_keys_parser(sub: Any) -> None:
    """Add ``keys`` and its actions to the ``sluice`` subcommands (``sub``: argparse's
    ``add_subparsers`` answer)."""
    keys = sub.add_parser(
        "keys",
        help="issue, list and revoke tenants' API keys on a running gateway",
        description="Manage API keys through a running gateway's admin API (--url or "
        f"{URL_ENV}; the admin token from {TOKEN_ENV}). Changes apply without a restart.",
    )
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    issue = actions.add_parser(
        "issue", help="issue a key; prints the secret once", description="Issue a new API key for a tenant."
    )
    issue.add_argument("--tenant", required=True, help="the tenant the key belongs to")
    listing = actions.add_parser(
        "list", help="list keys by id and prefix", description="List keys by id and prefix (never a secret)."
    )
    listing.add_argument("--tenant", help="only this tenant's keys (default: every tenant's)")
    revoke = actions.add_parser("revoke", help="revoke a key by id", description="Revoke a key by its id.")
    revoke.add_argument("--tenant", required=True, help="the tenant the key belongs to")
    revoke.add_argument("key_id", help="the key's id (key_...), as `sluice keys list` shows it")
    for parser in (issue, listing, revoke):
        parser.add_argument(
            "--url",
            default=None,
            help=f"the admin API's base URL (default: ${URL_ENV}, else {DEFAULT_ADMIN_URL})",
        )


def run_keys(args: argparse.Namespace) -> int:
    """Run ``sluice keys <action>``; returns the exit code."""
    base = (args.url or os.environ.get(URL_ENV) or DEFAULT_ADMIN_URL).rstrip("/")
    try:
        if args.keys_command == "issue":
            return _issue(base, args.tenant)
        if args.keys_command == "list":
            return _list(base, args.tenant)
        return _revoke(base, args.tenant, args.key_id)
    except KeysCommandError as exc:
        print(f"sluice keys {args.keys_command}: {exc}", file=sys.stderr)
        return 1


def _keys_path(tenant: str, key_id: str | None = None) -> str:
    path = f"/sluice/v1/tenants/{urllib.parse.quote(tenant, safe='')}/keys"
    return path if key_id is None else f"{path}/{urllib.parse.quote(key_id, safe='')}"


def _call(base: str, method: str, path: str) -> Any:
    """The JSON answer of ``method path`` on the admin API; ``KeysCommandError`` with the
    gateway's own message on an error status, or why it could not be reached."""
    headers = {"Accept": "application/json"}
    token = os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token.strip()}"
    request = urllib.request.Request(base + path, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        raise KeysCommandError(f"{exc.code}: {_message(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise KeysCommandError(
            f"cannot reach the admin API at {base} ({reason}); set --url or {URL_ENV}"
        ) from None


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200] or "no message"


def _issue(base: str, tenant: str) -> int:
    key = _call(base, "POST", _keys_path(tenant))
    print(key["secret"])
    print(
        f"issued {key['id']} for {key['tenant']} (prefix {key['prefix']}); the secret above is shown "
        "only this once",
        file=sys.stderr,
    )
    return 0


def _list(base: str, tenant: str | None) -> int:
    if tenant is None:
        tenants = [t["id"] for t in _call(base, "GET", "/sluice/v1/tenants")["data"]]
    else:
        tenants = [tenant]
    rows = [key for name in tenants for key in _call(base, "GET", _keys_path(name))["data"]]
    print(f"{'ID':<21} {'TENANT':<20} {'PREFIX':<15} {'SOURCE':<9} CREATED")
    for key in rows:
        created = "-" if key["created_at"] is None else _iso(key["created_at"])
        print(f"{key['id']:<21} {key['tenant']:<20} {key['prefix'] or '-':<15} {key['source']:<9} {created}")
    return 0


def _iso(unix_s: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _revoke(base: str, tenant: str, key_id: str) -> int:
    _call(base, "DELETE", _keys_path(tenant, key_id))
    print(f"revoked {key_id} of {tenant}", file=sys.stderr)
    return 0
