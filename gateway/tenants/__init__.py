"""Tenants: API key hashes to tenants, their fair-share weights, budgets and classes.

``config`` holds the YAML sections (``TenantsSettings``) and the embedded demo tenant; ``keys``
the hashing (``hash_api_key``, what ``sluice hash-key`` prints); ``auth`` the ``Authenticator``
that maps an ``Authorization`` header to a ``Tenant`` or an ``AuthError``; ``keys_file`` the
loader of the optional keys file. These are pure: no I/O except reading the keys file, no
logging. Not imported here: ``pricing`` (what a request costs in weighted tokens, and the token
weights), ``live`` (the aiohttp middleware that authenticates, reserves and settles on the
request path), ``admin_api`` and ``recent`` (``GET /sluice/v1/tenants``, recent 429s, the tenant
gauges' refresh), ``key_store``, ``redis_keys`` and ``keys_api`` (keys issued, listed and revoked
while the gateway runs, in the keys file or Redis) and ``keys_cli`` (``sluice keys``).
"""

from gateway.tenants.auth import Authenticator, AuthError, AuthFailure, Tenant, bearer_token
from gateway.tenants.config import (
    ANONYMOUS_TENANT,
    DEMO_API_KEY,
    DEMO_TENANT,
    AuthSettings,
    TenantSettings,
    TenantsSettings,
    class_violations,
    demo_tenants,
)
from gateway.tenants.keys import hash_api_key
from gateway.tenants.keys_file import apply_keys_file, keys_file_path, load_keys_file, parse_keys_file

__all__ = [
    "ANONYMOUS_TENANT",
    "DEMO_API_KEY",
    "DEMO_TENANT",
    "AuthError",
    "AuthFailure",
    "AuthSettings",
    "Authenticator",
    "Tenant",
    "TenantSettings",
    "TenantsSettings",
    "apply_keys_file",
    "bearer_token",
    "class_violations",
    "demo_tenants",
    "hash_api_key",
    "keys_file_path",
    "load_keys_file",
    "parse_keys_file",
]
