"""The keys file: more API key hashes per tenant, kept apart from the main configuration.

The file maps tenant names to lists of entries: ``sha256:`` hashes written by hand, or mappings
``{id, prefix, hash, created_at}`` of keys issued by ``sluice keys`` (``gateway.tenants.key_store``,
which rewrites the file). ``apply_keys_file`` reads the file
``TenantsSettings.keys_file`` names, validates it as strictly as ``api_keys`` (hashes only, every
tenant configured, no hash used twice anywhere) and returns the settings with the hashes added.
It runs wherever the configuration is loaded, so the keys file reloads with the rest. Problems
raise ``gateway.config.load.ConfigError``, one line each, secrets shown as ``<redacted>``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Final

import yaml

from gateway.config.source import ConfigError, StrictSafeLoader, read_text
from gateway.tenants.config import TenantsSettings
from gateway.tenants.keys import REDACTED, key_hash_problem, normalise_key_hash

__all__ = ["KEY_ID", "apply_keys_file", "keys_file_path", "load_keys_file", "parse_keys_file"]

#: An issued key's id (``gateway.tenants.key_store``).
KEY_ID: Final = re.compile(r"^key_[0-9a-f]{16}$")
#: The fields of an issued key's entry; ``hash`` is required.
_ISSUED_FIELDS: Final = frozenset({"id", "prefix", "hash", "created_at"})

_EXPECTED: Final = "expected a mapping of tenant names to lists of key hashes (sha256:<hex>)"


def keys_file_path(settings: TenantsSettings, base_dir: Path | None = None) -> Path | None:
    """The keys file ``settings`` names, relative paths taken from ``base_dir`` (the configuration
    file's directory; ``None``: the working directory); ``None`` when there is none."""
    if settings.keys_file is None:
        return None
    path = Path(settings.keys_file)
    return path if path.is_absolute() or base_dir is None else base_dir / path


def apply_keys_file(settings: TenantsSettings, base_dir: Path | None = None) -> TenantsSettings:
    """``settings`` with the keys file's hashes appended to each tenant's ``api_keys`` and
    ``keys_file`` made absolute; ``settings`` itself when it names no keys file. Raises
    ``ConfigError`` (for the keys file) on any problem."""
    path = keys_file_path(settings, base_dir)
    if path is None:
        return settings
    extra = load_keys_file(path, settings)
    tenants = {
        name: tenant.model_copy(update={"api_keys": [*tenant.api_keys, *extra.get(name, [])]})
        for name, tenant in settings.tenants.items()
    }
    # Validated above, rule by rule: copying without re-validation keeps the snapshot frozen and exact.
    # The path is kept absolute, so that the running gateway finds the file it rewrites
    # (``gateway.tenants.key_store``) whatever its working directory.
    return settings.model_copy(update={"tenants": tenants, "keys_file": str(path.resolve())})


def load_keys_file(path: str | Path, settings: TenantsSettings) -> dict[str, list[str]]:
    """Read and validate the keys file at ``path`` against ``settings``; see ``parse_keys_file``."""
    text = read_text(path)
    try:
        data = yaml.load(text, Loader=StrictSafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(path, [_describe_yaml_error(exc)]) from None
    problems, keys = _check(data, settings)
    if problems:
        raise ConfigError(path, problems)
    return keys


def parse_keys_file(data: object, settings: TenantsSettings, source: str) -> dict[str, list[str]]:
    """Validate parsed keys-file data (``None``: an empty file, no keys) against ``settings``.

    Returns canonical hashes per tenant. Raises ``ConfigError(source, problems)`` listing every
    problem: not a mapping, a tenant not configured in ``settings``, a value that is not a list,
    an entry that is not a ``sha256:`` hash (plaintext keys included), a hash used twice.
    """
    problems, keys = _check(data, settings)
    if problems:
        raise ConfigError(source, problems)
    return keys


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    """Where and what, without the offending line (``gateway.config.load`` shows it): it may hold a key."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return "invalid YAML"
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "syntax error"
    where = "(top level)" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{where}: invalid YAML: {problem} (the line is not shown: it may hold a key)"


def _unknown_tenant(name: object, position: int, known: list[str]) -> str:
    """A mapping key that is no configured tenant: shown only when it is close to a tenant's name
    (a typo); anything else may be a key pasted the wrong way round, so it is shown by position."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if isinstance(name, str) else []
    if close:
        return f"{name}: not a configured tenant; did you mean {close[0]!r}? (got {name!r})"
    listed = ", ".join(known) or "none"
    return f"(entry {position}): not a configured tenant (known: {listed}) (got {REDACTED!r})"


def _issued_problem(item: dict[object, object]) -> str | None:
    """Why an issued key's entry is not valid, as one line; ``None`` when it is."""
    if any(k not in _ISSUED_FIELDS for k in item):
        # Field names are not shown: a key pasted as a mapping's key would be.
        return f"unknown field; an issued key's entry has only {', '.join(sorted(_ISSUED_FIELDS))}"
    if "hash" not in item:
        return "an issued key's entry needs its hash"
    problem = key_hash_problem(item["hash"])
    if problem is not None:
        return f"hash: {problem}"
    key_id, prefix, created = item.get("id"), item.get("prefix"), item.get("created_at")
    if key_id is not None and not (isinstance(key_id, str) and KEY_ID.match(key_id)):
        return "id: expected key_ followed by 16 hex digits"
    if prefix is not None and not isinstance(prefix, str):
        return "prefix: expected a string"
    if created is not None and (isinstance(created, bool) or not isinstance(created, int | float)):
        return "created_at: expected Unix seconds"
    return None


def _check(data: object, settings: TenantsSettings) -> tuple[list[str], dict[str, list[str]]]:
    if data is None:
        return [], {}
    if not isinstance(data, dict):
        return [f"(top level): {_EXPECTED} (got {REDACTED!r})"], {}
    first = {
        key_hash: f"tenants.{name}.api_keys.{index} in the configuration"
        for name, tenant in settings.tenants.items()
        for index, key_hash in enumerate(tenant.api_keys)
    }
    problems: list[str] = []
    keys: dict[str, list[str]] = {}
    known = list(settings.tenants)
    for position, (name, hashes) in enumerate(data.items(), start=1):
        if not (isinstance(name, str) and name in settings.tenants):
            problems.append(_unknown_tenant(name, position, known))
            continue
        if not isinstance(hashes, list):
            problems.append(f"{name}: should be a list of key hashes (sha256:<hex>) (got {REDACTED!r})")
            continue
        keys[name] = []
        for index, item in enumerate(hashes):
            problem = _issued_problem(item) if isinstance(item, dict) else key_hash_problem(item)
            if problem is not None:
                problems.append(f"{name}.{index}: {problem} (got {REDACTED!r})")
                continue
            raw = item["hash"] if isinstance(item, dict) else item
            assert isinstance(raw, str)
            key_hash = normalise_key_hash(raw)
            if key_hash in first:
                where = first[key_hash]
                problems.append(f"{name}.{index}: key hash already used at {where} (got {key_hash!r})")
                continue
            first[key_hash] = f"{name}.{index} in this file"
            keys[name].append(key_hash)
    return problems, keys
