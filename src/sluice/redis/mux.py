"""One multiplexed Redis connection per event loop, for the query service's hot path.

Under load, many requests wait on Redis at once. With a connection pool each of them takes a
connection, writes its commands with a syscall of its own and reads its replies with another,
and the client library's per-call machinery (pool, retries, pipeline objects) costs more CPU
than the lookup. `MuxClient` instead keeps one connection and appends every caller's commands
to one output buffer that is written once per event-loop turn. Replies come back in order
(RESP is ordered per connection) and are handed out by a queue of waiting callers. Redis then
also reads many commands per read, so it spends less time on I/O too.

Scope: a single Redis over TCP or a Unix socket, with optional AUTH and SELECT. TLS and
clusters keep using redis-py's asyncio clients (see `sluice.server.app.AsyncClients`).

Errors are redis-py's exception classes, so callers handle both clients alike:
`ConnectionError` (connect failed, connection lost; every waiting caller gets it and the next
call reconnects), `TimeoutError` (no reply within `socket_timeout`: the connection is dropped,
since later replies could no longer be matched), `NoScriptError`, `BusyLoadingError` (Redis is
loading its dataset) and `ResponseError`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import hiredis
from redis import exceptions

Command = tuple[Any, ...] | bytes  # arguments, or a command already RESP-encoded


class _Waiter:
    __slots__ = ("future", "left", "replies", "sent")

    def __init__(self, future: asyncio.Future[list[Any]], count: int) -> None:
        self.future = future
        self.left = count
        self.replies: list[Any] = []
        self.sent = time.monotonic()


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout_s: float | None) -> None:
        self.reader = hiredis.Reader(replyError=exceptions.ResponseError)
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.timeout_s = timeout_s
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exceptions.ConnectionError(f"connection to redis lost: {exc or 'closed'}"))

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiters = self.waiters
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as e:
                self._abort(exceptions.ConnectionError(f"bad reply from redis: {e}"))
                return
            if reply is False:
                return
            if not waiters:
                self._abort(exceptions.ConnectionError("redis sent a reply nobody asked for"))
                return
            head = waiters[0]
            head.replies.append(reply)
            head.left -= 1
            if head.left == 0:
                waiters.popleft()
                if not head.future.done():  # its caller may have gone (cancelled)
                    head.future.set_result(head.replies)

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        if self.lost is not None:
            raise self.lost
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        if not commands:
            future.set_result([])
            return future
        if not self.out:
            self._loop.call_soon(self._flush)
        self.out.extend(c if isinstance(c, bytes) else hiredis.pack_command(c) for c in commands)
        self.waiters.append(_Waiter(future, len(commands)))
        if self.timeout_s is not None and self._watchdog is None:
            self._watchdog = self._loop.call_later(self.timeout_s, self._check_timeout)
        return future

    def _flush(self) -> None:
        if self.out and self.transport is not None and self.lost is None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def _check_timeout(self) -> None:
        self._watchdog = None
        if not self.waiters or self.timeout_s is None:
            return
        waited = time.monotonic() - self.waiters[0].sent
        if waited >= self.timeout_s:
            self._abort(exceptions.TimeoutError(f"no reply from redis in {self.timeout_s:g} s"))
        else:
            self._watchdog = self._loop.call_later(self.timeout_s - waited, self._check_timeout)

    def _abort(self, error: Exception) -> None:
        self._fail(error)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, error: Exception) -> None:
        if self.lost is None:
            self.lost = error
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.out.clear()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error)


class MuxClient:
    """Commands from any number of concurrent callers over one connection (made on first use,
    and again after a loss). Bound to the event loop it is first used on."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        socket_timeout: float | None = None,
        socket_connect_timeout: float | None = None,
        **_: Any,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.db, self.username, self.password = db, username, password
        self.timeout_s = socket_timeout
        self.connect_timeout_s = socket_connect_timeout
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @property
    def where(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """The replies to `commands` (argument tuples, or bytes already in RESP), in order.
        Raises NoScriptError or ResponseError if one
        of them failed (after all were answered), ConnectionError or TimeoutError."""
        proto = self._proto
        if proto is None or proto.lost is not None:
            proto = await self._connected()
        replies = await proto.send(commands)
        for reply in replies:
            if isinstance(reply, exceptions.ResponseError):
                raise _typed(reply)
        return replies

    async def script_load(self, source: str) -> str:
        (sha,) = await self.execute([("SCRIPT", "LOAD", source)])
        return sha.decode() if isinstance(sha, bytes) else str(sha)

    async def aclose(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None

    async def _connected(self) -> _Protocol:
        if self._connecting is None:  # the first caller connects; the others wait for it
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            proto = await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None
        return proto

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.path:
                    _, proto = await loop.create_unix_connection(
                        lambda: _Protocol(self.timeout_s), self.path
                    )
                else:
                    _, proto = await loop.create_connection(
                        lambda: _Protocol(self.timeout_s), self.host, self.port
                    )
        except (OSError, TimeoutError) as e:
            raise exceptions.ConnectionError(
                f"Error connecting to redis at {self.where}: {e or type(e).__name__}"
            ) from None
        hello: list[Command] = []
        if self.password is not None:
            auth = (self.username, self.password) if self.username else (self.password,)
            hello.append(("AUTH", *auth))
        if self.db:
            hello.append(("SELECT", self.db))
        replies = await proto.send(hello)
        for reply in replies:
            if isinstance(reply, exceptions.ResponseError):
                proto._abort(exceptions.ConnectionError(str(reply)))
                if "AUTH" in str(reply).upper() or "PASS" in str(reply).upper():
                    raise exceptions.AuthenticationError(str(reply))
                raise exceptions.ConnectionError(f"redis at {self.where}: {reply}")
        self._proto = proto
        return proto


def _typed(error: exceptions.ResponseError) -> exceptions.RedisError:
    message = str(error)
    if message.startswith("NOSCRIPT"):
        return exceptions.NoScriptError(message)
    if message.startswith("LOADING"):
        return exceptions.BusyLoadingError(message)
    return error
