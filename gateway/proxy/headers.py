"""Which headers cross the proxy, each way: the client's to the replica, the replica's back.

``forwarded(request, authorization)`` builds the replica's request headers (hop-by-hop ones and
what aiohttp or Sluice sets dropped, a tenant's API key never passed on, ``X-Forwarded-For``
appended, the request id added); ``relayed(headers)`` the client's response headers from the
replica's. Pure functions of their arguments.
"""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.observability.logs import REQUEST_ID, REQUEST_ID_HEADER
from gateway.tenants.live import TENANT

#: RFC 9110 section 7.6.1 hop-by-hop headers, never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: Client headers not forwarded upstream: recomputed by aiohttp or set by Sluice itself. The
#: body Sluice sends is its own, uncompressed (aiohttp's server inflates a gzip or deflate body on
#: reading), so the client's ``Content-Encoding`` does not describe it; and it is sent whole, so
#: an ``Expect: 100-continue`` (curl's, for bodies over 1 KiB) was answered here and is not passed
#: on (as Envoy does).
_NOT_FORWARDED_UP = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "expect",
    "accept-encoding",
    "x-forwarded-for",  # sent again with the client's address appended (``forwarded``)
    REQUEST_ID_HEADER,
}
#: The header a tenant's API key came in (never forwarded once the tenancy middleware used it).
_TENANT_KEY = frozenset({"authorization"})
#: Replica headers not relayed to the client: recomputed by aiohttp or set by Sluice itself.
_NOT_RELAYED_DOWN = HOP_BY_HOP | {
    "content-length",
    "content-encoding",
    "date",
    "server",
    REQUEST_ID_HEADER,
}


def forwarded(request: web.Request, authorization: str | None = None) -> CIMultiDict[str]:
    """Headers for the replica: the client's minus hop-by-hop ones, plus ours.

    A tenant's API key authenticates it to Sluice, never to the replicas: once the tenancy
    middleware has authenticated a tenant, the client's ``Authorization`` stays here.
    ``authorization``: the replica's own key (``replicas[].api_key_env``), which replaces the
    client's ``Authorization`` whatever it was.

    As nginx's ``$proxy_add_x_forwarded_for`` and Envoy do, the client's address is appended to
    ``X-Forwarded-For`` (after the chain the client sent, its headers joined in order), so a
    replica's logs (vLLM behind ``--forwarded-allow-ips``) name the client, not Sluice; and
    ``X-Forwarded-Proto`` says the client's scheme unless a proxy in front already said it.
    """
    client = request.headers
    skipped = _NOT_FORWARDED_UP
    connection = client.get("connection")
    if connection is not None:
        named = {token.strip().lower() for token in connection.split(",")}
        if not named <= skipped:  # usually just "keep-alive": nothing new
            skipped = skipped | named
    if "authorization" not in skipped and (authorization is not None or request.get(TENANT) is not None):
        skipped = skipped | _TENANT_KEY
    # One add per header: cheaper than CIMultiDict(generator), and this runs on every request.
    headers: CIMultiDict[str] = CIMultiDict()
    for key, value in client.items():
        if key.lower() not in skipped:
            headers.add(key, value)
    chain = client.getall("X-Forwarded-For", None)  # usually none: the client is the first hop
    peer = request.remote
    if chain is None:
        if peer:
            headers["X-Forwarded-For"] = peer
    else:
        headers["X-Forwarded-For"] = ", ".join([*chain, peer] if peer else chain)
    if "X-Forwarded-Proto" not in headers:
        headers["X-Forwarded-Proto"] = request.scheme
    if authorization is not None:
        headers["Authorization"] = authorization
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"
    headers[REQUEST_ID_HEADER] = request[REQUEST_ID]
    return headers


def relayed(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Replica headers for the client: minus hop-by-hop and the ones aiohttp or Sluice set."""
    relayed: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in _NOT_RELAYED_DOWN:
            relayed.add(key, value)
    return relayed
