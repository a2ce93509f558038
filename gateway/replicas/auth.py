"""The replicas' own API keys on every request Sluice sends them (``replicas[].api_key_env``).

``replica_auth(store)`` is a client middleware of the gateway's upstream session: a request to a
replica whose settings name a key (health, models, info, ``/metrics``) gets ``Authorization:
Bearer <key>``, read from the environment at each request. Without it a replica started with
``--api-key`` answers 401 and never passes its health check. The proxy sets the header itself and
opts out of the middleware on its hot path.
"""

from __future__ import annotations

from aiohttp import ClientRequest, ClientResponse, hdrs
from aiohttp.client_middlewares import ClientHandlerType, ClientMiddlewareType

from gateway.config.store import SettingsStore

__all__ = ["replica_auth"]


def replica_auth(store: SettingsStore) -> ClientMiddlewareType:
    """The client middleware; replicas are matched by URL prefix against the current settings."""

    async def middleware(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        url = str(request.url)
        for replica in store.current.replicas:
            if replica.api_key_env is None:
                continue
            base = replica.url.rstrip("/")
            if url == base or url.startswith(base + "/"):
                authorization = replica.authorization()
                if authorization is not None:
                    request.headers[hdrs.AUTHORIZATION] = authorization
                break
        return await handler(request)

    return middleware
