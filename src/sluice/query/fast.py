"""The hot path: `GET /v1/metrics/{name}` answered without FastAPI's routing and validation.

A single lookup is the request a risk engine sends most, and on a small machine FastAPI's
per-request work (route matching, dependency resolution, parameter models, response classes)
costs more CPU than the lookup itself. `FastLookups` is a plain ASGI middleware that parses the
query string, runs the engine, and writes the JSON answer itself. It sits inside the bearer-token
guard, so authentication applies as before.

Only successful lookups are answered here. Any error, and any request that is not a plain
`GET /v1/metrics/<name>`, goes on to the full application, which answers it exactly as it always
has (status, error body, OpenAPI): the fast path never has to keep a second copy of the error
rules in step with the first.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/v1/metrics/"
ROUTE = PREFIX + "{name}"


class _Route:
    """What the request timer reads from `scope["route"]`: the route's template."""

    path = ROUTE


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
    window = ""
    end: str | None = None
    for k, v in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        if k == "key":
            keys.append(v)
        elif k == "window":
            window = v  # the last one wins, as in the full application
        elif k == "end":
            end = v
    return name, keys, window, end


class FastLookups:
    def __init__(self, app: ASGIApp, engine: Any, clients: Any) -> None:
        self.app = app
        self.engine = engine
        self.clients = clients

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parsed = parse_lookup(scope)
        if parsed is None:
            return await self.app(scope, receive, send)
        try:
            lookup = self.engine.lookup(*parsed)
            (result,) = await self.engine.arun([lookup], self.clients.get())
            body = orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY)
        except Exception:  # noqa: BLE001 - the full application answers every error
            return await self.app(scope, receive, send)
        scope["route"] = _Route
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
