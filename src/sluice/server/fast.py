"""The hot paths: lookups answered without FastAPI's routing and validation.

Single lookups (`GET /v1/metrics/{name}`) and batches (`POST /v1/query`) are what a risk engine
sends most, and on a small machine FastAPI's per-request work (route matching, dependency
resolution, parameter and body models, response classes, telemetry hooks) costs more CPU than
the lookup itself. `FastLookups` is a plain ASGI middleware that parses the request, runs the
engine, and writes the JSON answer itself. It sits inside the bearer-token guard, so
authentication applies as before.

Only successful lookups are answered here. Any error, any body that is not plainly well-formed,
and any other request goes on to the full application, which answers it exactly as it always
has (status, error body, OpenAPI): the fast path never has to keep a second copy of the error
rules in step with the first. A batch's body, once read, is replayed to the application, marked
as JSON: a batch is JSON whatever its content type says (`curl -d` says form data), on both
paths, so a batch the fast path would answer is read the same when it has an error to report.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

import orjson
import redis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.query.engine import MAX_BATCH
from sluice.server.middleware import unavailable

PREFIX = "/v1/metrics/"
ROUTE = PREFIX + "{name}"
BATCH = "/v1/query"
MAX_BATCH_BODY = 1024 * 1024  # larger batch bodies take the full application's path


class _Route:
    """What the request timer reads from `scope["route"]`: the route's template."""

    def __init__(self, path: str) -> None:
        self.path = path


_LOOKUP_ROUTE = _Route(ROUTE)
_BATCH_ROUTE = _Route(BATCH)
_HEADERS = [(b"content-type", b"application/json")]


def json_body(scope: Scope) -> Scope:
    """`scope` with its body's content type said to be JSON (the module's docstring)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, *_HEADERS]}


def parse_lookup(scope: Scope) -> tuple[str, list[str], str, str | None] | None:
    """(name, keys, window, end) of a plain lookup request, or None for anything else."""
    if scope["type"] != "http" or scope["method"] != "GET":
        return None
    path: str = scope["path"]
    if not path.startswith(PREFIX):
        return None
    name = path[len(PREFIX) :]
    if not name or "/" in name:
        return None
    keys: list[str] = []
    window: str | None = None
    end: str | None = None
    try:  # a parameter that is not UTF-8: the full application refuses it
        pairs = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True,
                          errors="strict")  # fmt: skip
    except UnicodeDecodeError:
        return None
    for k, v in pairs:
        if k == "key":
            keys.append(v)
        elif k == "window":
            if window is not None:
                return None  # given twice: the full application refuses it
            window = v
        elif k == "end":
            if end is not None:
                return None
            end = v
    return name, keys, window or "", end


def parse_batch(body: bytes, max_queries: int) -> list[tuple[str, list[str], str, int | None]]:
    """The queries of a `POST /v1/query` body whose every field has exactly the type the API's
    model declares: (metric, keys, window, end). Raises ValueError for anything else (bad
    JSON, a missing field, a number where a string belongs, too many queries), which the full
    application then answers with its own message."""
    doc = orjson.loads(body)
    queries = doc.get("queries") if isinstance(doc, dict) else None
    if not isinstance(queries, list) or not 0 < len(queries) <= max_queries:
        raise ValueError("no plain list of queries")
    out = []
    for q in queries:
        if not isinstance(q, dict):
            raise ValueError("a query is not an object")
        metric, key, window, end = q.get("metric"), q.get("key"), q.get("window"), q.get("end")
        keys = [key] if isinstance(key, str) else key
        if (
            not isinstance(metric, str)
            or not isinstance(window, str)
            or not isinstance(keys, list)
            or not all(isinstance(k, str) for k in keys)
            or not (end is None or (isinstance(end, int) and not isinstance(end, bool)))
        ):
            raise ValueError("a field has another type than the model's")
        out.append((metric, keys, window, end))
    return out


async def read_body(receive: Receive, limit: int) -> tuple[bytes, list[Message], bool]:
    """Read a request body up to `limit` bytes: (body, the messages read, whether it is all)."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return b"", messages, False
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(m.get("body", b"") for m in messages), messages, True
        if size > limit:
            return b"", messages, False


def replaying(messages: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A `receive` that first gives back the messages already read, then reads on."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


async def send_json(send: Send, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*_HEADERS, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


_STORE_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class FastLookups:
    def __init__(self, app: ASGIApp, engine: Any, clients: Any) -> None:
        self.app = app
        self.engine = engine
        self.clients = clients

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == BATCH:
            return await self._batch(scope, receive, send)
        parsed = parse_lookup(scope)
        if parsed is None:
            return await self.app(scope, receive, send)
        try:
            lookup = self.engine.lookup(*parsed)
            (result,) = await self.engine.arun([lookup], self.clients.get())
            body = orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY)
        except _STORE_ERRORS as e:  # answered here: the application would wait on it again
            scope["route"] = _LOOKUP_ROUTE
            return await unavailable(e)(scope, receive, send)
        except Exception:  # noqa: BLE001 - the full application answers every other error
            return await self.app(scope, receive, send)
        scope["route"] = _LOOKUP_ROUTE
        await send_json(send, body)

    async def _batch(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw, messages, complete = await read_body(receive, MAX_BATCH_BODY)
        try:
            if not complete:
                raise ValueError("not a whole body within the fast path's limit")
            engine = self.engine
            lookups = [engine.lookup(*q) for q in parse_batch(raw, MAX_BATCH)]
            results = await engine.arun(lookups, self.clients.get())
            body = orjson.dumps({"results": results}, option=orjson.OPT_SERIALIZE_NUMPY)
        except _STORE_ERRORS as e:  # answered here: the application would wait on it again
            scope["route"] = _BATCH_ROUTE
            return await unavailable(e)(scope, receive, send)
        except Exception:  # noqa: BLE001 - the full application answers every other error
            return await self.app(json_body(scope), replaying(messages, receive), send)
        scope["route"] = _BATCH_ROUTE
        await send_json(send, body)
