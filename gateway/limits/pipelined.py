"""Script calls on one pipelined Redis connection: the limiter's fast path to a single server.

``PipelinedScripts.evalsha(script, keys, args, deadline=t)`` writes one ``EVALSHA`` on a shared
connection; replies are matched to callers in order. ``for_client`` returns ``None`` for any client
but plain TCP, RESP2, undecoded replies (TLS, Unix sockets and clusters keep redis-py). Contract,
as redis-py's ``Script``: ``NOSCRIPT`` loads the script and retries once (never ``EVAL``); a lost
connection is retried once on a fresh one; a call cancelled or past ``deadline`` (the loop's clock,
connect and retry included: ``TimeoutError``) leaves its reply to be read and dropped, and a
connection silent for ``stale_after_s`` is closed; errors raise redis-py's ``ResponseError``
family or ``ConnectionError``. ``Packed(*values)`` pre-encodes arguments that calls repeat. Its
cost against redis-py is in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Sequence
from typing import Any, Final, cast

import hiredis
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript

__all__ = ["Packed", "PipelinedScripts", "for_client", "pack"]

#: Connection keyword arguments ``for_client`` understands; any other one set to something other
#: than its default means a client this module does not speak for.
_UNDERSTOOD = frozenset(
    {
        "host",
        "port",
        "db",
        "username",
        "password",
        "socket_timeout",
        "socket_connect_timeout",
        "orig_host_address",
        "orig_socket_timeout",
        "orig_socket_connect_timeout",
        "himport_registry",
        "maint_notifications_pool_handler",
        "maint_notifications_config",
        "retry",
        "encoding",
        "encoding_errors",
        "decode_responses",
        "protocol",
    }
)


def for_client(client: object, stale_after_s: float) -> PipelinedScripts | None:
    """The fast path to ``client``'s server, or ``None`` when ``client`` is not a plain TCP,
    RESP2, undecoded ``redis.asyncio.Redis`` (see the module docstring)."""
    if not isinstance(client, redis.asyncio.Redis):
        return None
    pool = client.connection_pool
    if pool.connection_class is not Connection:
        return None
    kwargs: dict[str, Any] = dict(pool.connection_kwargs)
    if set(kwargs) - _UNDERSTOOD:
        return None
    if kwargs.get("decode_responses") or kwargs.get("protocol") not in (None, 2, "2"):
        return None
    if kwargs.get("encoding", "utf-8") != "utf-8":
        return None
    return PipelinedScripts(
        host=str(kwargs.get("host", "localhost")),
        port=int(kwargs.get("port", 6379)),
        db=int(kwargs.get("db") or 0),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        stale_after_s=stale_after_s,
    )


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _encode(value: str | bytes | float | int) -> bytes:
    """redis-py's encoding of one argument: bytes as they are, numbers by ``repr``, str as UTF-8."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        raise redis.exceptions.DataError("Invalid input of type: 'bool'")
    if isinstance(value, (int, float)):
        return repr(value).encode()
    return value.encode()


def pack(*parts: str | bytes | float | int) -> bytes:
    """One RESP command (an array of bulk strings)."""
    return b"*%d\r\n" % len(parts) + b"".join(_bulk(_encode(p)) for p in parts)


class Packed:
    """A run of command arguments encoded once (RESP bulk strings), written as they are by
    ``PipelinedScripts.evalsha``: ``count`` arguments, ``data`` their bytes. Immutable."""

    __slots__ = ("count", "data")

    def __init__(self, *values: str | bytes | float | int) -> None:
        self.count = len(values)
        self.data = b"".join(_bulk(_encode(v)) for v in values)

    @classmethod
    def keys(cls, keys: Sequence[str]) -> Packed:
        """A script's keys as ``EVALSHA`` takes them: their number, then each key."""
        return cls(len(keys), *keys)

    def __repr__(self) -> str:
        return f"Packed({self.count} arguments, {self.data!r})"


_Arg = str | bytes | float | int | Packed


class _Protocol(asyncio.Protocol):
    """One connection: writes commands, hands replies to the waiting futures in order."""

    def __init__(self, stale_after_s: float = math.inf) -> None:
        self.transport: asyncio.Transport | None = None
        #: The calls written and not answered yet, in order: (future, deadline on the loop's
        #: clock; ``inf``: none).
        self.waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.reader = hiredis.Reader()
        self.closed = False
        #: ``time.monotonic()`` of the last bytes received (or of the connection).
        self.heard_at = time.monotonic()
        #: A connection silent this long when a call's deadline passes is closed (hung).
        self.stale_after_s = stale_after_s
        #: The one timer that ends overdue calls (``_sweep``), and the instant it is armed for.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's and uvloop's TCP transports set TCP_NODELAY themselves. (uvloop's transports
        # are not ``asyncio.Transport`` subclasses, hence the cast, not an isinstance check.)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.heard_at = time.monotonic()
        reader = self.reader
        try:
            reader.feed(data)
            while (reply := reader.gets()) is not False:
                if not self.waiting:
                    raise redis.exceptions.ConnectionError("a reply nobody asked for")
                future = self.waiting.popleft()[0]
                if not future.done():  # a cancelled or overdue caller's reply is read and dropped
                    future.set_result(reply)
        except Exception as exc:  # a protocol error: nothing more on this connection is trusted
            self.close(redis.exceptions.ConnectionError(f"Redis protocol error: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(redis.exceptions.ConnectionError(f"Connection closed by server: {exc!r}"))

    def close(self, exc: Exception) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        while self.waiting:
            future = self.waiting.popleft()[0]
            if not future.done():
                future.set_exception(exc)

    def send(self, command: bytes, deadline: float = math.inf) -> asyncio.Future[Any]:
        """Write ``command``; the future gets its reply (an error reply as an exception instance),
        or ``TimeoutError`` once ``deadline`` (the loop's clock) has passed without it."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise redis.exceptions.ConnectionError("connection closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.waiting.append((future, deadline))
        self.transport.write(command)
        if deadline < self._timer_at:
            self._arm(loop, deadline)
        return future

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._sweep), at

    def _sweep(self) -> None:
        """The timer: end the calls whose deadline has passed (their replies, when they come, are
        dropped), close the connection if it is hung, re-arm for the earliest deadline left."""
        self._timer, self._timer_at = None, math.inf
        loop = asyncio.get_running_loop()
        now = loop.time()
        overdue = False
        earliest = math.inf
        for future, deadline in self.waiting:
            if future.done():
                continue
            if deadline <= now:
                future.set_exception(TimeoutError("no reply from Redis within the call's deadline"))
                overdue = True
            elif deadline < earliest:
                earliest = deadline
        if overdue and time.monotonic() - self.heard_at >= self.stale_after_s:
            self.close(redis.exceptions.TimeoutError("the server stopped answering"))
            return
        if earliest < math.inf:
            self._arm(loop, earliest)


class PipelinedScripts:
    """Script calls to one Redis server on one pipelined connection; see the module docstring."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        stale_after_s: float,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self._username, self._password = username, password
        self.stale_after_s = stale_after_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        #: EVALSHA's head per script sha: ``*n``-less prefix ``EVALSHA <sha>``.
        self._heads: dict[str, bytes] = {}
        #: Connections opened (the first one included), for tests and curiosity.
        self.connects = 0
        #: ``SCRIPT LOAD`` commands sent on every new connection before any call (``preload``).
        self._preloaded: dict[str, bytes] = {}

    def preload(self, *scripts: AsyncScript) -> None:
        """``SCRIPT LOAD`` ``scripts`` on every connection this opens, before any ``EVALSHA`` on it.

        Without it the first call of a script on a fresh server (the gateway's start, a restarted
        Redis) takes a ``NOSCRIPT``, a load and a second ``EVALSHA``: a round trip later than it
        was sent, behind calls sent after it. A settle that arrives behind the same tenant's next
        reserve leaves that reserve counting the finished request's concurrency slot: a client
        allowed one request at a time, sending the next as soon as an answer ends, got a 429.
        """
        for script in scripts:
            self._preloaded[script.sha] = _load_command(script)

    async def evalsha(
        self,
        script: AsyncScript,
        keys: Sequence[str] | Packed,
        args: Sequence[_Arg],
        *,
        deadline: float = math.inf,
    ) -> Any:
        """Run ``script`` (loaded on NOSCRIPT) and return its reply as redis-py would (bytes for
        strings, ints, lists); raises as the module docstring says. ``keys``: the keys, or
        ``Packed.keys(keys)``; ``args``: values or ``Packed`` runs of them. ``deadline``: the
        loop's clock (``loop.time()``) past which the call raises ``TimeoutError``."""
        sha = script.sha
        head = self._heads.get(sha)
        if head is None:
            head = self._heads[sha] = _bulk(b"EVALSHA") + _bulk(sha.encode())
        if isinstance(keys, Packed):
            parts = [head, keys.data]
            count = 2 + keys.count
        else:
            parts = [head, _bulk(b"%d" % len(keys)), *[_bulk(key.encode()) for key in keys]]
            count = 3 + len(keys)
        for arg in args:
            if isinstance(arg, Packed):
                parts.append(arg.data)
                count += arg.count
            else:
                parts.append(_bulk(_encode(arg)))
                count += 1
        command = b"*%d\r\n" % count + b"".join(parts)
        try:
            return await self._call(command, deadline)
        except redis.exceptions.NoScriptError:
            await self._call(_load_command(script), deadline)
            return await self._call(command, deadline)

    async def ping(self, *, deadline: float = math.inf) -> None:
        """One ``PING`` on the shared connection (opened, scripts preloaded, if needed); raises as
        ``evalsha`` does. A connection it opens is the one the next script call uses."""
        await self._call(_PING, deadline)

    async def _call(self, command: bytes, deadline: float = math.inf) -> Any:
        """One command and its reply; a connection lost under it is retried once, on a new one
        (within the same ``deadline``)."""
        for attempt in (0, 1):
            protocol = self._protocol
            if protocol is None or protocol.closed:
                if deadline < math.inf:
                    async with asyncio.timeout_at(deadline):
                        protocol = await self._connect()
                else:
                    protocol = await self._connect()
            elif deadline <= asyncio.get_running_loop().time():
                raise TimeoutError("no reply from Redis within the call's deadline")
            try:
                reply = await self._wait(protocol, protocol.send(command, deadline))
            except redis.exceptions.ConnectionError:
                if attempt == 1:
                    raise
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise _response_error(str(reply))
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def _wait(self, protocol: _Protocol, future: asyncio.Future[Any]) -> Any:
        try:
            return await future
        except asyncio.CancelledError:
            # The caller's timeout: the reply will be read and dropped. A server that has said
            # nothing for that long is hung (or the link is): drop the connection, as redis-py does.
            if time.monotonic() - protocol.heard_at >= self.stale_after_s:
                protocol.close(redis.exceptions.TimeoutError("the server stopped answering"))
            raise

    async def _connect(self) -> _Protocol:
        """The current connection, opening one if needed (one at a time, shared by the callers)."""
        task = self._connecting
        if task is None or task.done():
            task = self._connecting = asyncio.get_running_loop().create_task(self._open())
            task.add_done_callback(_retrieve)
        # A caller cancelled while waiting must not cancel the connect the others wait for.
        protocol = await asyncio.shield(task)
        return protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        stale = self.stale_after_s
        _, protocol = await loop.create_connection(lambda: _Protocol(stale), self.host, self.port)
        self.connects += 1
        try:
            hello: list[bytes] = []
            if self._username or self._password:  # as redis-py authenticates
                password = self._password or ""
                auth = ("AUTH", self._username, password) if self._username else ("AUTH", password)
                hello.append(pack(*auth))
            if self.db:
                hello.append(pack("SELECT", self.db))
            for command in hello:
                reply = await protocol.send(command)
                if isinstance(reply, hiredis.ReplyError):
                    raise _response_error(str(reply))
            # Sent together, answered before any call can use the connection. A refused load (an
            # ACL without SCRIPT) is left to EVALSHA, which reports what is wrong when called.
            loads = [protocol.send(command) for command in self._preloaded.values()]
            for load in loads:
                await load
        except BaseException:
            protocol.close(redis.exceptions.ConnectionError("connection set-up failed"))
            raise
        old, self._protocol = self._protocol, protocol
        if old is not None and not old.closed:
            old.close(redis.exceptions.ConnectionError("replaced"))
        return protocol

    async def close(self) -> None:
        """Close the connection (calls still waiting get ``ConnectionError``)."""
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._protocol is not None:
            self._protocol.close(redis.exceptions.ConnectionError("closed"))
            self._protocol = None


_PING: Final = pack("PING")


def _load_command(script: AsyncScript) -> bytes:
    """The ``SCRIPT LOAD`` command of ``script`` (its text as redis-py keeps it: str, bytes or a
    memoryview)."""
    text = script.script
    return pack("SCRIPT", "LOAD", bytes(text) if isinstance(text, memoryview) else text)


def _retrieve(task: asyncio.Task[_Protocol]) -> None:
    """Mark a connect's failure as seen (its callers, if any are left, got it too)."""
    if not task.cancelled():
        task.exception()


def _response_error(message: str) -> redis.exceptions.ResponseError:
    """The redis-py exception for an error reply (its own classes for NOSCRIPT and NOPERM)."""
    if message.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(message)
    if message.startswith("NOPERM"):
        return redis.exceptions.NoPermissionError(message)
    return redis.exceptions.ResponseError(message)
