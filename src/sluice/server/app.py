"""The HTTP API (DESIGN §3) and dashboard, as one ASGI application.

    Timer ─▶ Guard ─▶ FastLookups ─▶ FastAPI (routes.py)
    (latency) (token)  (GET and batch lookups, answered without FastAPI)

JSON in and out; every error is {"error": {"code", "message"}} (`middleware.error`). While Redis
loads its dataset (a restart) every answer that needs it is 503 `redis_loading` with
Retry-After, and /healthz says not ready.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from sluice import collector
from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config, load_config
from sluice.errors import BackpressureError, QueryError, SluiceError
from sluice.logs import LOG_LEVEL_ENV, setup_logging
from sluice.query.answers import AnswerLog
from sluice.query.engine import QueryEngine
from sluice.redis.connection import client_for
from sluice.server.clients import AsyncClients
from sluice.server.fast import FastLookups
from sluice.server.middleware import (
    Guard,
    Head,
    ORJSONResponse,
    SluiceApp,
    Timer,
    error,
    unavailable,
)
from sluice.server.routes import Api, router
from sluice.source.log import LogUnavailable
from sluice.status.history import Sampler
from sluice.status.prometheus import RequestTimer


def app_from_env() -> SluiceApp:
    """App factory for `sluice serve --workers N`: each worker process builds its own app from
    SLUICE_CONFIG (the config path) and SLUICE_REDIS_URL (set by the parent process)."""
    setup_logging(os.environ.get(LOG_LEVEL_ENV, "info"))  # a fresh process: no handler yet
    cfg = load_config(os.environ["SLUICE_CONFIG"])
    return create_app(cfg, client_for(os.environ["SLUICE_REDIS_URL"]))


def create_app(
    cfg: Config, client: Any, clock: Clock = SYSTEM_CLOCK, history: bool = True
) -> SluiceApp:
    """The API and dashboard over `client`. With `history`, the app's lifespan runs a
    `Sampler` that records the per-second history the dashboard charts (one small write a
    second, shared by every worker); the lifespan runs under uvicorn, not under a bare
    TestClient. Makes no connection itself."""
    engine = QueryEngine(cfg, client, clock, AnswerLog.from_config(cfg, clock))
    api = Api(cfg, client, clock, engine, AsyncClients(client), RequestTimer())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Everything built so far (modules, the app, the config) lives as long as the process.
        # Frozen, the cyclic collector stops re-scanning it in its full collections: under load
        # those were tens of milliseconds each, and they made the tail of the latency.
        collector.freeze()
        sampler = Sampler(client, cfg, clock).start() if history else None
        try:
            yield
        finally:
            if sampler is not None:
                await run_in_threadpool(sampler.stop)

    app = FastAPI(
        title="Sluice",
        version="0.1.0",
        description="Per-entity metrics over any window, merged from time slices.",
        default_response_class=ORJSONResponse,
        lifespan=lifespan,
    )
    app.state.sluice = api
    app.state.engine = engine
    app.mount("/static", StaticFiles(packages=[("sluice.web", "static")]), name="static")
    app.include_router(router)
    for kind, handler in _HANDLERS.items():
        app.add_exception_handler(kind, handler)
    fast = FastLookups(app, engine, api.aclients)
    return SluiceApp(app, Head(Timer(Guard(fast, cfg.server.token), api.timer)))


async def _query_error(_: Request, e: Exception) -> Response:
    assert isinstance(e, QueryError)
    if details := e.details():
        body = {"error": {"code": e.code, "message": str(e), **details}}
        return ORJSONResponse(body, e.status)
    return error(e.status, e.code, str(e))


async def _backpressure(_: Request, e: Exception) -> Response:
    assert isinstance(e, BackpressureError)
    retry = max(1, round(e.retry_after_s))
    return error(429, "backpressure", str(e), headers={"Retry-After": str(retry)})


_MEMBERS = frozenset({"str", "int", "list[str]"})  # the union members of `params.Lookup`


async def _validation(_: Request, e: Exception) -> Response:
    assert isinstance(e, RequestValidationError)
    err = e.errors()[0]
    if err.get("type") == "json_invalid":
        why = (err.get("ctx") or {}).get("error")
        return error(400, "bad_request", f"body is not valid JSON: {why}" if why else
                     "body is not valid JSON")  # fmt: skip
    # Not the request's parts, nor pydantic's names of a union's members (`key.list[str][0]`).
    parts = [p for p in err.get("loc", ())
             if p not in ("query", "body", "path") and p not in _MEMBERS]  # fmt: skip
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    return error(400, "bad_request", f"`{where or 'body'}`: {err.get('msg', 'invalid')}")


# Starlette's own answers (no such route, a method the route does not take) in Sluice's shape.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


async def _http(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    code = _HTTP_CODES.get(e.status_code, "http_error")
    message = {404: f"no such path: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        e.status_code, str(e.detail))  # fmt: skip
    return error(e.status_code, code, message, headers=dict(e.headers or {}))


async def _unavailable(_: Request, e: Exception) -> Response:
    return unavailable(e)


async def _log_unavailable(_: Request, e: Exception) -> Response:
    return error(503, "log_unavailable", str(e))


_HANDLERS: dict[Any, Any] = {
    QueryError: _query_error,
    BackpressureError: _backpressure,
    RequestValidationError: _validation,
    HTTPException: _http,
    redis.RedisError: _unavailable,
    redis.exceptions.RedisClusterException: _unavailable,  # slots not covered (a failover)
    LogUnavailable: _log_unavailable,  # producing while Kafka is down: 503, not 500
}

__all__ = ["SluiceError", "app_from_env", "create_app"]
