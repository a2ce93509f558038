"""``read_body``: a request's body as aiohttp's ``request.read()`` gives it (chunked or not,
compressed or not, aiohttp's 413 past ``client_max_size``), copied once, and cached where
``request.read()`` finds it (this fails if an aiohttp release moves that cache)."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from gateway.http.request_body import read_body

Client = Callable[[web.Application], Awaitable[TestClient[Any, Any]]]
BODY = bytes(range(256)) * 1024  # 256 KiB


async def _echo(request: web.Request) -> web.Response:
    body = await read_body(request)
    again = await request.read()
    return web.json_response({"size": len(body), "same": again is body, "equal": body == BODY})


def _app(client_max_size: int = 1024**2) -> web.Application:
    app = web.Application(client_max_size=client_max_size)
    app.router.add_post("/", _echo)
    return app


async def _chunks(size: int, step: int = 10_000) -> AsyncIterator[bytes]:
    for start in range(0, size, step):
        yield BODY[start : start + step]


@pytest.mark.parametrize("how", ["content-length", "chunked", "gzip"])
async def test_the_body_is_read_once_and_cached_for_request_read(aiohttp_client: Client, how: str) -> None:
    client = await aiohttp_client(_app())
    if how == "content-length":
        resp = await client.post("/", data=BODY)
    elif how == "chunked":
        resp = await client.post("/", data=_chunks(len(BODY)))
    else:
        resp = await client.post("/", data=gzip.compress(BODY), headers={"Content-Encoding": "gzip"})

    assert resp.status == 200
    assert await resp.json() == {"size": len(BODY), "same": True, "equal": True}


async def test_empty_bodies_are_read_as_empty(aiohttp_client: Client) -> None:
    """aiohttp hands every empty body the same reader, which says "end of a chunk" once it was
    read: reading must stop there all the same (it used to spin the event loop)."""
    client = await aiohttp_client(_app())
    for _ in range(3):
        resp = await client.post("/", data=b"")
        assert await resp.json() == {"size": 0, "same": True, "equal": False}


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_client_max_size_is_aiohttps_413(aiohttp_client: Client, chunked: bool) -> None:
    client = await aiohttp_client(_app(client_max_size=100_000))
    resp = await client.post("/", data=_chunks(len(BODY)) if chunked else BODY)
    assert resp.status == 413
