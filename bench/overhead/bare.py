"""A bare pass-through proxy on aiohttp + uvloop: the floor a Python proxy cannot go below.

Every request (any method, any path) is sent to ``--upstream`` with its body and headers (less
the hop-by-hop ones) over one pooled ``ClientSession``; an answer with a ``Content-Length`` is
read whole and returned, anything else (an SSE stream) is relayed chunk by chunk as it arrives.
No parsing, no auth, no limits, no metrics, no logging: the same libraries as Sluice, none of its
work. The overhead bench's "bare" row, the baseline of "Sluice keeps >= 50 % of a bare proxy's
throughput".

Run: ``python -m bench.overhead.bare --port N --upstream http://127.0.0.1:M``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

#: Headers a proxy must not forward (RFC 9110 7.6.1), plus those aiohttp sets itself.
HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    }
)


def build_app(upstream: str) -> web.Application:
    """The proxy in front of ``upstream`` (a base URL without trailing slash)."""
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            app[session_key] = session
            yield

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with app[session_key].request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as up:
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP}
            if up.content_length is not None:
                return web.Response(status=up.status, body=await up.read(), headers=out_headers)
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a bare aiohttp pass-through proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    args = parser.parse_args(argv)
    serve(build_app(args.upstream.rstrip("/")), args.host, args.port)


def serve(app: web.Application, host: str, port: int) -> None:
    """Run ``app`` on uvloop until interrupted, without aiohttp's access log or banner."""
    import uvloop

    web.run_app(app, host=host, port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
