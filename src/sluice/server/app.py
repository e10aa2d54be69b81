"""The HTTP API (DESIGN §3). JSON in and out; every error is {"error": {"code", "message"}}."""

from __future__ import annotations

import contextlib
import gc
import hmac
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import redis
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import BackpressureError, BadQuery, QueryError, SluiceError
from sluice.flow.valves import IngestValve
from sluice.query.engine import QueryEngine
from sluice.redis.mux import MuxClient
from sluice.server.fast import FastLookups
from sluice.source.admission import ingest_valve
from sluice.source.producer import Producer
from sluice.status.history import HISTORY_LEN, Sampler, read_history
from sluice.status.prometheus import RequestTimer
from sluice.status.snapshot import read_status

MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_EVENTS_PER_REQUEST = 100_000


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return ORJSONResponse({"error": {"code": code, "message": message}}, status, headers=headers)


class _Guard:
    """Bearer token on /v1/* (when configured) and a cap on the declared body size.

    A plain ASGI middleware: it looks at headers only and costs one dict scan per request.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            if self.expected is not None and scope["path"].startswith("/v1/"):
                got = headers.get(b"authorization", b"")
                if not hmac.compare_digest(got, self.expected):
                    deny = error(401, "unauthorized", "missing or wrong bearer token")
                    return await deny(scope, receive, send)
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > MAX_BODY_BYTES:
                big = error(413, "too_large", f"request body is over {MAX_BODY_BYTES} bytes")
                return await big(scope, receive, send)
        await self.app(scope, receive, send)


class _Timer:
    """Records each request's latency by route template into the Prometheus histogram.

    Outermost, so it times the whole request, including the response's serialisation. The
    route is read after the app ran: Starlette's router leaves the matched route in the scope.
    """

    def __init__(self, app: ASGIApp, timer: RequestTimer) -> None:
        self.app = app
        self.timer = timer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is not None:
                self.timer.observe(scope["method"], route, time.perf_counter() - t0)


class SluiceApp:
    """The ASGI application `serve` runs: request timing, then the token guard, then the lookup
    fast paths, in front of the FastAPI application (`api`). They wrap it from outside, so a
    lookup answered by the fast path never enters FastAPI's own middleware stack."""

    def __init__(self, api: FastAPI, outer: ASGIApp) -> None:
        self.api = api
        self._outer = outer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._outer(scope, receive, send)


class Lookup(BaseModel):
    metric: str = Field(description="metric or derived metric name")
    key: list[str] | str = Field(description="key value(s), one per key field")
    window: str = Field(description="window length, e.g. 15m", examples=["15m"])
    end: int | None = Field(None, description="window end in epoch ms; default now")


class BatchQuery(BaseModel):
    queries: list[Lookup] = Field(max_length=1000)


class AsyncClients:
    """One asyncio Redis client per event loop, built from the sync client's connection settings:
    a `MuxClient` (one multiplexed connection) for a single Redis over TCP or a Unix socket,
    redis-py's asyncio clients for TLS and for a cluster.

    uvicorn runs one loop per worker; Starlette's TestClient may start a loop per request, and an
    asyncio connection must not be used from another loop than the one that opened it.
    """

    def __init__(self, client: Any) -> None:
        from sluice.redis.connection import is_cluster

        self._by_loop: dict[int, Any] = {}
        self.cluster: list[tuple[str, int]] | None = None
        self.kind = ""
        if is_cluster(client):
            # Seeds: the masters the sync client found; credentials and TLS from its settings.
            self.cluster = [(n.host, n.port) for n in client.get_primaries()]
            conn = client.nodes_manager.connection_kwargs
            keep = ("username", "password", "socket_timeout", "socket_connect_timeout")
            self.kwargs = {k: v for k, v in conn.items() if k in keep}
            if conn.get("connection_class") is not None:
                self.kwargs["ssl"] = conn["connection_class"].__name__ == "SSLConnection"
            return
        pool = client.connection_pool
        kind = pool.connection_class.__name__  # Connection, SSLConnection or UnixDomain...
        allowed = _ASYNC_KWARGS + (_SSL_KWARGS if kind == "SSLConnection" else ())
        self.kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in allowed}
        self.kind = kind

    def get(self) -> Any:
        import asyncio

        import redis.asyncio as aredis

        loop = id(asyncio.get_running_loop())
        found = self._by_loop.get(loop)
        if found is None and self.cluster is not None:
            from redis.asyncio.cluster import ClusterNode, RedisCluster

            nodes = [ClusterNode(h, p) for h, p in self.cluster]
            found = self._by_loop[loop] = RedisCluster(startup_nodes=nodes, **self.kwargs)
        if found is None:
            if len(self._by_loop) > 64:  # loops of finished test requests
                self._by_loop.clear()
            if self.kind == "SSLConnection":
                pool = aredis.ConnectionPool(connection_class=aredis.SSLConnection, **self.kwargs)
                found = aredis.Redis(connection_pool=pool)
            else:  # TCP or a Unix socket: one multiplexed connection
                found = MuxClient(**self.kwargs)
            self._by_loop[loop] = found
        return found


_ASYNC_KWARGS: tuple[str, ...] = (
    "host", "port", "db", "username", "password", "socket_timeout", "socket_connect_timeout",
    "path", "client_name",
)  # fmt: skip
_SSL_KWARGS = ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_check_hostname")


def app_from_env() -> SluiceApp:
    """App factory for `sluice serve --workers N`: each worker process builds its own app from
    SLUICE_CONFIG (the config path) and SLUICE_REDIS_URL (set by the parent process)."""
    import os

    from sluice.config import load_config
    from sluice.logs import LOG_LEVEL_ENV, setup_logging
    from sluice.redis.connection import client_for

    setup_logging(os.environ.get(LOG_LEVEL_ENV, "info"))  # a fresh process: no handler yet
    cfg = load_config(os.environ["SLUICE_CONFIG"])
    return create_app(cfg, client_for(os.environ["SLUICE_REDIS_URL"]))


def create_app(
    cfg: Config, client: Any, clock: Clock = SYSTEM_CLOCK, history: bool = True
) -> SluiceApp:
    """The API and dashboard over `client`. With `history`, the app's lifespan runs a
    `Sampler` that records the per-second history the dashboard charts (one small write a
    second, shared by every worker); the lifespan runs under uvicorn, not under a bare
    TestClient."""
    engine = QueryEngine(cfg, client, clock)
    aclients = AsyncClients(client)
    timer = RequestTimer()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Everything built so far (modules, the app, the config) lives as long as the process.
        # Frozen, the cyclic collector stops re-scanning it in its full collections: under load
        # those were tens of milliseconds each, and they made the tail of the latency.
        gc.collect()
        gc.freeze()
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
    app.mount("/static", StaticFiles(packages=[("sluice.web", "static")]), name="static")
    app.state.engine = engine
    valves: list[IngestValve] = []
    valve_lock = threading.Lock()

    def worker_valve() -> IngestValve:
        """This worker's ingest task, made on the first POST (a query-only server has none)."""
        with valve_lock:
            if not valves:
                valves.append(ingest_valve(cfg, client, clock))
            return valves[0]

    @app.exception_handler(QueryError)
    async def _query_error(_: Request, e: QueryError) -> Response:
        return error(e.status, e.code, str(e))

    @app.exception_handler(BackpressureError)
    async def _bp(_: Request, e: BackpressureError) -> Response:
        retry = max(1, round(e.retry_after_s))
        return error(429, "backpressure", str(e), headers={"Retry-After": str(retry)})

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return error(400, "bad_request", f"body is not valid JSON: {err.get('ctx', {})}")
        parts = [p for p in err.get("loc", ()) if p not in ("query", "body", "path")]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
        return error(400, "bad_request", f"`{where or 'body'}`: {err.get('msg', 'invalid')}")

    @app.exception_handler(redis.RedisError)
    async def _redis_down(_: Request, e: redis.RedisError) -> Response:
        return error(503, "unavailable", f"the slice store is unavailable: {e}")

    @app.get("/v1/metrics")
    def list_metrics() -> dict[str, Any]:
        """The metric definitions (and derived formulas) this server answers for."""
        return {"metrics": engine.definitions()}

    @app.get("/v1/metrics/{name}")
    async def get_metric(
        name: str,
        key: list[str] = Query(default=[], description="key value(s), one per key field"),  # noqa: B008
        window: str = Query(default="", description="window length, e.g. 15m"),
        end: str | None = Query(default=None, description="window end, epoch ms; default now"),
    ) -> dict[str, Any]:
        """Metric `name` for `key` over (end - window, end]."""
        lookup = engine.lookup(name, key, window, end)
        return (await engine.arun([lookup], aclients.get()))[0]

    @app.get("/v1/metrics/{name}/series")
    def get_series(
        name: str,
        key: list[str] = Query(default=[], description="key value(s), one per key field"),  # noqa: B008
        window: str = Query(default="", description="window length, e.g. 1h"),
        end: str | None = Query(default=None, description="window end, epoch ms; default now"),
        step: str | None = Query(default=None, description="point width; default the slice"),
    ) -> dict[str, Any]:
        """Metric `name` for `key` per `step` over (end - window, end], for charts."""
        return engine.series(name, key, window, end, step)

    @app.post("/v1/query")
    async def batch_query(body: BatchQuery) -> dict[str, Any]:
        """Many lookups in one pipelined round trip."""
        lookups = []
        for i, q in enumerate(body.queries):
            try:
                lookups.append(engine.lookup(q.metric, q.key, q.window, q.end))
            except QueryError as e:
                e.args = (f"queries[{i}]: {e}",)
                raise
        return {"results": await engine.arun(lookups, aclients.get())}

    @app.post("/v1/events", status_code=202)
    async def ingest(request: Request) -> dict[str, Any]:
        """Ingest a JSON array of events, or NDJSON. Answers 202 with the count accepted."""
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise QueryError(f"request body is over {MAX_BODY_BYTES} bytes", "body")
        events = _parse_events(raw)

        def send() -> None:  # blocking Redis calls: off the event loop
            wait = worker_valve().try_admit(len(events))
            if wait > 0:
                raise BackpressureError(wait, "input is backpressured; retry later")
            producer = Producer.from_config(cfg, client, flow=False)
            producer.send_many(events)
            producer.flush()

        await run_in_threadpool(send)
        return {"accepted": len(events)}

    @app.get("/v1/status")
    def status(
        history: str | None = Query(
            default=None, description="also the per-second history of the last N seconds (≤ 600)"
        ),
    ) -> dict[str, Any]:
        """Backlog, rates, freshness, flow state, supervisor health and the audit's books;
        with `history=N`, also the samples of the last N seconds, oldest first."""
        seconds = _parse_history(history)
        out = read_status(client, cfg, clock.now_ms())
        if seconds is not None:
            out["history"] = read_history(client, seconds)
        return out

    @app.get("/v1/dead-letters")
    def dead_letters(
        limit: str | None = Query(default=None, description="how many, 1 to 1000; default 50"),
        reason: str | None = Query(default=None, description="only this reason, e.g. bad_json"),
    ) -> dict[str, Any]:
        """The newest dead letters, newest first: `total` in the stream, `by_reason` counted
        since the start, and `items` (entry id, idx, reason, field, raw, ts, written_ms)."""
        from sluice.status.dead_letters import parse_limit, parse_reason, read_dead_letters

        return read_dead_letters(client, cfg, parse_limit(limit), parse_reason(reason))

    @app.get("/healthz")
    def healthz() -> Response:
        """200 while Redis answers and the pipeline is not failing; 503 otherwise."""
        from sluice.status.snapshot import pipeline_health

        try:
            client.ping()
            pipeline = pipeline_health(client, clock.now_ms())
        except redis.RedisError as e:
            return error(503, "unavailable", f"redis: {e}")
        if pipeline["state"] == "failing":
            return error(
                503,
                "pipeline_failing",
                f"the pipeline failed {pipeline['consecutive_failures']} times in a row;"
                f" last error: {pipeline['last_error']}",
            )
        return ORJSONResponse({"status": "ok", "redis": "ok", "pipeline": pipeline["state"]})

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> Response:
        """Prometheus text format: the pipeline's state from Redis, and request latency."""
        from sluice.status.freshness import read_histogram
        from sluice.status.prometheus import exposition, redis_health

        health = redis_health(client)
        st = fresh = None
        if health["up"]:
            try:
                st = read_status(client, cfg, clock.now_ms())
                fresh = read_histogram(client)
            except redis.RedisError:
                health = {"up": 0}
        body, ctype = exposition(st, health, fresh, timer)
        return Response(body, media_type=ctype)

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> Response:
        """The dashboard: one page, its scripts and styles under /static."""
        from sluice.web.page import dashboard_html

        return HTMLResponse(dashboard_html())

    return SluiceApp(
        app, _Timer(_Guard(FastLookups(app, engine, aclients), cfg.server.token), timer)
    )


def _parse_history(value: str | None) -> int | None:
    """The `history` query parameter: seconds from 0 to HISTORY_LEN, or QueryError (400)."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or int(value) > HISTORY_LEN:
        raise BadQuery(
            f"`history` must be a number of seconds from 0 to {HISTORY_LEN}, got {value!r}",
            "history",
        )
    return int(value)


def _parse_events(raw: bytes) -> list[dict[str, Any]]:
    """A JSON array of objects, or NDJSON (one object per line). Raises QueryError (400)."""
    text = raw.strip()
    if not text:
        raise QueryError("body is empty; send a JSON array of events or NDJSON", "body")
    events: Any
    if text[:1] == b"[":
        try:
            events = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise QueryError(f"body is not a valid JSON array: {e}", "body") from None
    else:
        events = []
        for n, line in enumerate(text.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                raise QueryError(f"NDJSON line {n} is not valid JSON: {e}", "body") from None
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise QueryError(f"event {i} is not a JSON object", "body")
    if len(events) > MAX_EVENTS_PER_REQUEST:
        raise QueryError(f"at most {MAX_EVENTS_PER_REQUEST} events per request", "body")
    try:  # orjson reads deeper nesting than it writes: refuse it before anything is sent
        orjson.dumps(events)
    except orjson.JSONEncodeError as e:
        raise QueryError(f"body cannot be re-encoded as JSON: {e}", "body") from None
    return list(events)


__all__ = ["SluiceError", "create_app"]
