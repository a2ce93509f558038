"""The keys admin API: issue, list and revoke a tenant's API keys while the gateway runs.

``POST /sluice/v1/tenants/{id}/keys`` issues a key (201; the body holds the secret, the only time
it is shown, with ``Cache-Control: no-store``); ``GET .../keys`` lists the tenant's keys by id and
prefix (hand-written ones too), never a secret or a hash; ``DELETE .../keys/{key_id}`` revokes
one (404 ``key_not_found``; 409 ``key_not_revocable`` for a key written in the configuration).
All behind the admin token. The store is Redis when ``limits.backend: redis`` (every gateway
sees a change within ``redis_keys.REDIS_POLL_S`` seconds), else the keys file; a change applies
to this gateway's authentication at once. Every change is logged (``sluice.keys``: tenant, id,
prefix; never the secret). Operator guide: docs/tenants.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

from aiohttp import web

from gateway.config.store import SettingsStore
from gateway.http.errors import GatewayError, InvalidRequest, RouteNotFound
from gateway.keys import STORE
from gateway.limits.redis import connect
from gateway.tasks import running
from gateway.tenants.admin_api import TenantsAdmin
from gateway.tenants.key_store import FileKeyStore, KeyStore, KeyStoreError
from gateway.tenants.keys_file import keys_file_path
from gateway.tenants.live import Tenancy
from gateway.tenants.redis_keys import RedisKeyStore

__all__ = ["KEYS_TIMEOUT_S", "KEY_STORE", "KeysApi", "file_store", "install_keys_api", "key_store"]

log = logging.getLogger("sluice.keys")

#: Least seconds a key store call to Redis may take (key changes are rare; the limiter's
#: millisecond budget is for the request path).
KEYS_TIMEOUT_S: Final = 1.0


def store_error(exc: KeyStoreError) -> GatewayError:
    """The answer to a change the key store could not make: a client error (409), or a server
    error (503) when its storage did not answer."""
    if exc.status >= 500:
        return GatewayError(exc.message, code=exc.code, status=exc.status)
    return InvalidRequest(exc.message, code=exc.code, status=exc.status)


def file_store(store: SettingsStore) -> FileKeyStore:
    """The keys-file store of ``store``'s settings (``tenants.keys_file``, read once)."""
    path = keys_file_path(store.current.tenants)
    return FileKeyStore(None if path is None else Path(path), lambda: store.current.tenants)


def key_store(store: SettingsStore) -> KeyStore:
    """Where ``store``'s settings keep issued keys: Redis with ``limits.backend: redis``, else the
    keys file (chosen once, at startup)."""
    limits = store.current.limits
    if limits.backend != "redis" or limits.redis is None:
        return file_store(store)
    redis = limits.redis
    timeout_s = max(redis.timeout_s, KEYS_TIMEOUT_S)
    client = connect(redis.url, cluster=redis.cluster, timeout_s=timeout_s, max_connections=4)
    return RedisKeyStore(
        client, lambda: store.current.tenants, key_prefix=redis.key_prefix, timeout_s=timeout_s
    )


class KeysApi:
    """The key routes over one ``KeyStore``; each change is applied to ``tenancy`` at once."""

    def __init__(self, admin: TenantsAdmin, tenancy: Tenancy, keys: KeyStore) -> None:
        self.admin = admin
        self.tenancy = tenancy
        self.keys = keys

    def apply(self) -> None:
        """Authenticate with the store's current keys from now on."""
        self.tenancy.use_keys(*self.keys.snapshot())

    async def issue_view(self, request: web.Request) -> web.Response:
        """``POST /sluice/v1/tenants/{id}/keys``: a new key; the secret is in this answer only."""
        tenant = self.admin.tenant(request.match_info["id"]).name
        try:
            record, secret = await self.keys.issue(tenant)
        except KeyStoreError as exc:
            raise store_error(exc) from None
        self.apply()
        log.info("API key issued: tenant=%s id=%s prefix=%s", tenant, record.id, record.prefix)
        body = {**record.public(), "secret": secret}
        return web.json_response(body, status=201, headers={"Cache-Control": "no-store"})

    async def list_view(self, request: web.Request) -> web.Response:
        """``GET /sluice/v1/tenants/{id}/keys``: the tenant's keys, without secrets or hashes."""
        tenant = self.admin.tenant(request.match_info["id"]).name
        try:
            records = await self.keys.records(tenant)
        except KeyStoreError as exc:
            raise store_error(exc) from None
        return web.json_response({"object": "list", "data": [r.public() for r in records]})

    async def revoke_view(self, request: web.Request) -> web.Response:
        """``DELETE /sluice/v1/tenants/{id}/keys/{key_id}``: the key no longer opens anything."""
        tenant = self.admin.tenant(request.match_info["id"]).name
        key_id = request.match_info["key_id"]
        try:
            record = await self.keys.revoke(tenant, key_id)
        except KeyStoreError as exc:
            raise store_error(exc) from None
        if record is None:
            raise RouteNotFound(f"Tenant {tenant!r} has no key {key_id!r}.", code="key_not_found")
        self.apply()
        log.info("API key revoked: tenant=%s id=%s prefix=%s", tenant, record.id, record.prefix)
        return web.json_response({"id": record.id, "object": "api_key", "deleted": True})


KEY_STORE: Final = web.AppKey("key_store", KeysApi)


def install_keys_api(
    app: web.Application, admin_app: web.Application, admin: TenantsAdmin, tenancy: Tenancy
) -> KeysApi:
    """Add the key routes to ``admin_app`` and load the store's keys into ``tenancy`` at startup.
    The store is chosen at startup from ``limits.backend`` (restart required to change it)."""
    settings_store = app[STORE]
    api = KeysApi(admin, tenancy, key_store(settings_store))
    app[KEY_STORE] = api
    admin_app.router.add_post("/sluice/v1/tenants/{id}/keys", api.issue_view)
    admin_app.router.add_get("/sluice/v1/tenants/{id}/keys", api.list_view)
    admin_app.router.add_delete("/sluice/v1/tenants/{id}/keys/{key_id}", api.revoke_view)

    async def lifecycle(_app: web.Application) -> AsyncIterator[None]:
        keys = api.keys
        if not isinstance(keys, RedisKeyStore):
            api.apply()
            yield
            return
        try:
            await keys.refresh()
        except Exception as exc:
            log.warning("cannot read the issued API keys from Redis at startup (%s); retrying", exc)
        api.apply()
        try:
            async with running(keys.poll(api.apply), name="sluice-keys-poll"):
                yield
        finally:
            await keys.close()

    app.cleanup_ctx.append(lifecycle)
    return api
