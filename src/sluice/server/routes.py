"""The API's routes (DESIGN §3). Each reads what it needs from `request.app.state.sluice`, the
`Api` that `create_app` built; none keeps state of its own."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from sluice.clock import Clock
from sluice.config import Config
from sluice.errors import BackpressureError, BadEvent, PartlyWritten, QueryError, SluiceError
from sluice.flow.valves import IngestValve
from sluice.query.engine import QueryEngine
from sluice.redis.loading import is_loading
from sluice.server.clients import AsyncClients
from sluice.server.middleware import ORJSONResponse, error, redis_loading
from sluice.server.params import (
    ERROR_RESPONSES,
    BatchQuery,
    check_query,
    parse_events,
    parse_history,
    parse_limit,
    parse_reason,
)
from sluice.source.admission import ingest_valve
from sluice.source.producer import Producer
from sluice.source.waiting import read_log_state
from sluice.status.dead_letters import read_dead_letters
from sluice.status.freshness import read_histogram
from sluice.status.history import read_history
from sluice.status.prometheus import RequestTimer, exposition, redis_health
from sluice.status.roles import read_roles
from sluice.status.snapshot import pipeline_health, read_status
from sluice.web.page import dashboard_html

router = APIRouter(responses=ERROR_RESPONSES)


@dataclass
class Api:
    """What the routes share: the config, the Redis clients, the engine, the request timer, and
    this worker's ingest task (made on the first POST: a query-only server has none)."""

    cfg: Config
    client: Any
    clock: Clock
    engine: QueryEngine
    aclients: AsyncClients
    timer: RequestTimer
    _valve: IngestValve | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def valve(self) -> IngestValve:
        with self._lock:
            if self._valve is None:
                self._valve = ingest_valve(self.cfg, self.client, self.clock)
            return self._valve


def _api(request: Request) -> Api:
    api: Api = request.app.state.sluice
    return api


@router.get("/v1/metrics")
def list_metrics(request: Request) -> dict[str, Any]:
    """The metric definitions (and derived formulas) this server answers for."""
    return {"metrics": _api(request).engine.definitions()}


@router.get("/v1/metrics/{name}")
async def get_metric(
    request: Request,
    name: str,
    key: list[str] = Query(default=[], description="key value(s), one per key field"),  # noqa: B008
    window: str = Query(default="", description="window length, e.g. 15m"),
    end: str | None = Query(default=None, description="window end, epoch ms; default now"),
) -> dict[str, Any]:
    """Metric `name` for `key` over (end - window, end]."""
    check_query(request.scope["query_string"], ("window", "end"))
    api = _api(request)
    lookup = api.engine.lookup(name, key, window, end)
    return (await api.engine.arun([lookup], api.aclients.get()))[0]


@router.get("/v1/metrics/{name}/series")
def get_series(
    request: Request,
    name: str,
    key: list[str] = Query(default=[], description="key value(s), one per key field"),  # noqa: B008
    window: str = Query(default="", description="window length, e.g. 1h"),
    end: str | None = Query(default=None, description="window end, epoch ms; default now"),
    step: str | None = Query(default=None, description="point width; default the slice"),
) -> dict[str, Any]:
    """Metric `name` for `key` per `step` over (end - window, end], for charts."""
    check_query(request.scope["query_string"], ("window", "end", "step"))
    return _api(request).engine.series(name, key, window, end, step)


@router.post("/v1/query")
async def batch_query(request: Request, body: BatchQuery) -> dict[str, Any]:
    """Many lookups in one pipelined round trip."""
    api = _api(request)
    lookups = []
    for i, q in enumerate(body.queries):
        try:
            lookups.append(api.engine.lookup(q.metric, q.key, q.window, q.end))
        except QueryError as e:
            e.args = (f"queries[{i}]: {e}",)
            raise
    return {"results": await api.engine.arun(lookups, api.aclients.get())}


@router.post("/v1/events", status_code=202)
async def ingest(request: Request) -> dict[str, Any]:
    """Ingest a JSON array of events, or NDJSON. Answers 202 with the count accepted, or 429
    with Retry-After while the input is backpressured (nothing of it is written then)."""
    api = _api(request)
    raw = await request.body()  # at most MAX_BODY_BYTES (`middleware.Guard`)
    events = parse_events(raw)

    def send() -> None:  # blocking calls to the log: off the event loop
        wait = api.valve().try_admit(len(events), len(raw))
        if wait > 0:
            raise BackpressureError(wait, "input is backpressured; retry later")
        # Its marks serve this request's own retries only (`flush_rest`): kept a minute at
        # most, and removed once it is written
        producer = Producer.from_config(api.cfg, api.client, flow=False, mark_ttl_s=60)
        try:  # an event it cannot write: 400, none written
            shards = producer.buffer_all(events)
        except BadEvent as e:
            raise QueryError(str(e), "body") from None
        try:
            producer.flush()
        except Exception:
            if producer.pending() == len(events):
                raise  # none written: the request may be sent again whole
            flush_rest(producer, shards)
        producer.forget_marks()

    await run_in_threadpool(send)
    return {"accepted": len(events)}


PARTIAL_RETRY_S = 10.0
WAITING_AT_ONCE = 4  # requests that wait out a master at once, each holding a thread
PARTIAL_RETRIES = threading.BoundedSemaphore(WAITING_AT_ONCE)


def flush_rest(producer: Producer, shards: list[int], wait_s: float = PARTIAL_RETRY_S) -> None:
    """Some of a request's events were written and the rest were not (a Redis Cluster master
    that is down holds back its own shards only; `shards`: each event's). The rest are retried
    here for up to `wait_s`: the client's retry of the whole request would write the others
    twice. Raises PartlyWritten, naming the events not written, when they still cannot be.
    At most `WAITING_AT_ONCE` requests wait at once (each holds a thread the lookups share);
    the others try once more and answer at once."""
    waits = PARTIAL_RETRIES.acquire(blocking=False)
    deadline = time.monotonic() + (wait_s if waits else 0.0)
    try:
        _retry_until(producer, shards, deadline)
    finally:
        if waits:
            PARTIAL_RETRIES.release()


def _retry_until(producer: Producer, shards: list[int], deadline: float) -> None:
    while True:
        time.sleep(0.2)
        try:
            producer.flush()
            return
        except (redis.RedisError, SluiceError) as e:
            if time.monotonic() < deadline:
                continue
            held = producer.pending_shards()
            unwritten = [i for i, shard in enumerate(shards) if shard in held]
            n = len(shards)
            raise PartlyWritten(
                f"{n - len(unwritten):,} of the {n:,} events were written and the other"
                f" {len(unwritten):,} could not be ({e}): send those alone again (`unwritten`,"
                " their indices in this request); the whole request again would write the"
                " others twice",
                unwritten,
            ) from None


@router.get("/v1/status")
def status(
    request: Request,
    history: str | None = Query(
        default=None, description="also the per-second history of the last N seconds (≤ 600)"
    ),
) -> dict[str, Any]:
    """Backlog, rates, freshness, flow state, supervisor health, the log and the audit's
    books; with `history=N`, also the samples of the last N seconds, oldest first."""
    check_query(request.scope["query_string"], ("history",))
    api = _api(request)
    seconds = parse_history(history)
    out = read_status(api.client, api.cfg, api.clock.now_ms())
    if seconds is not None:
        out["history"] = read_history(api.client, seconds)
    return out


@router.get("/v1/dead-letters")
def dead_letters(
    request: Request,
    limit: str | None = Query(default=None, description="how many, 1 to 1000; default 50"),
    reason: str | None = Query(default=None, description="only this reason, e.g. bad_json"),
) -> dict[str, Any]:
    """The newest dead letters, newest first: `total` in the stream, `by_reason` counted since
    the start, and `items` (entry id, idx, reason, field, raw, ts, written_ms; a Kafka record's
    topic, partition and offset)."""
    check_query(request.scope["query_string"], ("limit", "reason"))
    api = _api(request)
    return read_dead_letters(api.client, api.cfg, parse_limit(limit), parse_reason(reason))


@router.get("/healthz")
def healthz(request: Request) -> Response:
    """200 while Redis answers and the pipeline is not failing; 503 otherwise."""
    api = _api(request)
    try:
        api.client.ping()
        now_ms = api.clock.now_ms()
        roles = read_roles(api.client, api.cfg, now_ms)
        # The log's state as its reader last wrote it (not the log itself: a probe stays fast
        # while a broker is down), so that a wait reads `waiting_for_log` here as elsewhere.
        waiting = read_log_state(api.client)
        pipeline = pipeline_health(api.client, now_ms, waiting, roles)
    except redis.RedisError as e:
        if is_loading(e):
            return redis_loading(e)
        return error(503, "unavailable", f"redis: {e}")
    if pipeline["state"] == "failing":
        return error(
            503,
            "pipeline_failing",
            f"the pipeline failed {pipeline['consecutive_failures']} times in a row;"
            f" last error: {pipeline['last_error']}",
        )
    return ORJSONResponse(
        {
            "status": "ok",
            "redis": "ok",
            "pipeline": pipeline["state"],
            "processes": [
                {k: p[k] for k in ("role", "host", "pid", "lease_age_ms")}
                for p in roles["processes"]
            ],
        }
    )


@router.get("/metrics", response_class=PlainTextResponse)
def prometheus(request: Request) -> Response:
    """Prometheus text format: the pipeline's state from Redis, and request latency."""
    api = _api(request)
    health = redis_health(api.client)
    st = fresh = None
    if health["up"]:
        try:
            st = read_status(api.client, api.cfg, api.clock.now_ms())
            fresh = read_histogram(api.client)
        except redis.RedisError:
            health = {"up": 0}
    body, ctype = exposition(st, health, fresh, api.timer)
    return Response(body, media_type=ctype)


@router.get("/", response_class=HTMLResponse)
def dashboard() -> Response:
    """The dashboard: one page, its scripts and styles under /static."""
    return HTMLResponse(dashboard_html())
