"""The ASGI layers in front of the FastAPI app: HEAD answered as GET without a body, request
timing, the bearer-token guard, and the JSON error body every error uses ({"error": {"code",
"message"}})."""

from __future__ import annotations

import hmac
import time
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.redis.loading import is_loading, is_transient
from sluice.status.prometheus import RequestTimer

MAX_BODY_BYTES = 10 * 1024 * 1024


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return ORJSONResponse({"error": {"code": code, "message": message}}, status, headers=headers)


LOADING_RETRY_AFTER_S = 1


def redis_loading(e: Exception) -> Response:
    """503 while Redis loads its dataset (a restart): transient, so with Retry-After."""
    return error(
        503,
        "redis_loading",
        f"redis is loading its dataset after a restart; retry shortly ({e})",
        headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
    )


def unavailable(e: Exception) -> Response:
    """503 for a Redis error that may clear (loading, with Retry-After; no connection; a
    failover), 500 for one every retry would get again (a key of the wrong type, say)."""
    if is_loading(e):
        return redis_loading(e)
    if is_transient(e):
        return error(503, "unavailable", f"the slice store is unavailable: {e}")
    return error(500, "store_error", f"the slice store refused the request: {e}")


class Guard:
    """Bearer token on /v1/* (when configured) and a cap on the body size: the declared one,
    or for a body sent without a length (chunked), the bytes as they are read.

    A plain ASGI middleware: a request without a chunked body costs it one dict scan.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = token.encode() if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            if self.expected is not None and scope["path"].startswith("/v1/"):
                scheme, _, got = headers.get(b"authorization", b"").partition(b" ")
                # The scheme is case-insensitive (RFC 9110, 11.1); the token is not.
                if scheme.lower() != b"bearer" or not hmac.compare_digest(got, self.expected):
                    deny = error(401, "unauthorized", "missing or wrong bearer token")
                    return await deny(scope, receive, send)
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > MAX_BODY_BYTES:
                return await _too_large()(scope, receive, send)
            if b"transfer-encoding" in headers:  # a chunked body: counted as it is read
                return await self._capped(scope, receive, send)
        await self.app(scope, receive, send)

    async def _capped(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app with a `receive` that raises TooLarge past MAX_BODY_BYTES: the application
        answers it 413 itself, and so does this where a part before it (the fast path) read."""
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _capped(receive), sending)
        except TooLarge:
            if started:
                raise
            await _too_large()(scope, receive, send)


class TooLarge(HTTPException):
    """A request body over MAX_BODY_BYTES, found as it is read (413 `too_large`)."""

    def __init__(self) -> None:
        super().__init__(413, f"request body is over {MAX_BODY_BYTES} bytes")


def _too_large() -> Response:
    return error(413, "too_large", f"request body is over {MAX_BODY_BYTES} bytes")


def _capped(receive: Receive) -> Receive:
    """`receive` that raises TooLarge once the body read passes MAX_BODY_BYTES: a body sent
    without a length (chunked) is not read whole into memory first."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise TooLarge
        return message

    return capped


class Timer:
    """Records each request's latency by route template into the Prometheus histogram.

    Outermost, so it times the whole request, including the response's serialisation. It
    records as the response's last body part is handed to the server, before its bytes can
    reach the client: a client that scrapes `/metrics` (from any worker) once it has its answer
    finds that request counted. The route is read then: Starlette's router leaves the matched
    route in the scope. A request that ends with no last body part (an error) is recorded as
    the app returns.
    """

    def __init__(self, app: ASGIApp, timer: RequestTimer) -> None:
        self.app = app
        self.timer = timer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        recorded = False

        def record() -> None:
            nonlocal recorded
            recorded = True
            route = getattr(scope.get("route"), "path", None)
            if route is not None:
                self.timer.observe(scope["method"], route, time.perf_counter() - t0)

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                record()
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            if not recorded:
                record()


class Head:
    """HEAD on any path that takes GET: the GET's status and headers (its Content-Length
    included), with no body. Monitors and load balancers probe `/healthz` so; the routes take
    GET only. Outermost: the layers inside it see a GET."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headless(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headless)


class SluiceApp:
    """The ASGI application `serve` runs: HEAD as GET, request timing, then the token guard, then
    the lookup fast paths, in front of the FastAPI application (`api`). They wrap it from
    outside, so a lookup answered by the fast path never enters FastAPI's own middleware
    stack."""

    def __init__(self, api: FastAPI, outer: ASGIApp) -> None:
        self.api = api
        self._outer = outer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._outer(scope, receive, send)
