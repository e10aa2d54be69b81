"""The lookup fast paths (`GET /v1/metrics/{name}`, `POST /v1/query`) against real Redis: they
answer exactly what the full application answers, alone; everything else (errors, odd bodies,
other routes) reaches the full application, with the body replayed."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from fastapi.testclient import TestClient

from sluice.query.engine import QueryEngine
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.server.app import AsyncClients, create_app
from sluice.server.fast import FastLookups, parse_batch, parse_lookup
from tests.conftest import make_config


def _scope(path: str, query: bytes = b"", method: str = "GET") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": query, "headers": []}


@pytest.mark.parametrize(
    ("path", "query", "method", "parsed"),
    [
        ("/v1/metrics/txn_count", b"key=c1&window=5m", "GET", ("txn_count", ["c1"], "5m", None)),
        ("/v1/metrics/avg", b"key=a&key=b%20c&window=1h&end=9", "GET",
         ("avg", ["a", "b c"], "1h", "9")),
        ("/v1/metrics/x", b"window=1m&other=1", "GET", ("x", [], "1m", None)),
        ("/v1/metrics/x", b"window=1m&window=2m", "GET", None),  # refused by the application
        ("/v1/metrics/x", b"window=1m&end=1&end=2", "GET", None),
        ("/v1/metrics/x", b"key=&window=", "GET", ("x", [""], "", None)),
        ("/v1/metrics/x/series", b"key=c1&window=5m", "GET", None),
        ("/v1/metrics/", b"", "GET", None),
        ("/v1/metrics", b"", "GET", None),
        ("/v1/metrics/x", b"key=c1&window=5m", "POST", None),
        ("/v1/status", b"", "GET", None),
    ],
)  # fmt: skip
def test_parse_lookup(path: str, query: bytes, method: str, parsed: Any) -> None:
    assert parse_lookup(_scope(path, query, method)) == parsed


@pytest.mark.parametrize(
    ("body", "parsed"),
    [
        (b'{"queries":[{"metric":"m","key":"k","window":"1m"}]}', [("m", ["k"], "1m", None)]),
        (b'{"queries":[{"metric":"m","key":["a","b"],"window":"5m","end":7,"x":1}],"y":2}',
         [("m", ["a", "b"], "5m", 7)]),
        (b'{"queries":[{"metric":"m","key":[],"window":"1m","end":null}]}',
         [("m", [], "1m", None)]),
    ],
)  # fmt: skip
def test_parse_batch_takes_bodies_of_the_models_types(body: bytes, parsed: Any) -> None:
    assert parse_batch(body, 1000) == parsed


@pytest.mark.parametrize(
    "body",
    [
        b"", b"not json", b"[]", b'{"queries":[]}', b'{"queries":{}}', b'{"queries":[1]}',
        b'{"queries":[{"key":"k","window":"1m"}]}',
        b'{"queries":[{"metric":"m","window":"1m"}]}',
        b'{"queries":[{"metric":"m","key":"k"}]}',
        b'{"queries":[{"metric":"m","key":1,"window":"1m"}]}',
        b'{"queries":[{"metric":"m","key":["k",2],"window":"1m"}]}',
        b'{"queries":[{"metric":"m","key":"k","window":60}]}',
        b'{"queries":[{"metric":"m","key":"k","window":"1m","end":"5"}]}',
        b'{"queries":[{"metric":"m","key":"k","window":"1m","end":true}]}',
        b'{"queries":[{"metric":"m","key":"k","window":"1m","end":1.5}]}',
        b'{"queries":[' + b",".join([b'{"metric":"m","key":"k","window":"1m"}'] * 3) + b"]}",
    ],
)  # fmt: skip
def test_parse_batch_refuses_everything_else(body: bytes) -> None:
    """The full application decides what these mean (400, or a lax conversion of its model)."""
    with pytest.raises(ValueError):
        parse_batch(body, 2)


def _seed(r: redis.Redis, cards: int) -> int:
    """Random 10 s slices of txn_count over the last 10 minutes, as the writer stores them."""
    rng = random.Random(7)
    now = time.time_ns() // 1_000_000
    newest = now // 10_000 * 10_000
    for c in range(cards):
        fields = {
            str(newest - 10_000 * i): f"1:{rng.randint(1, 9)}"
            for i in range(60)
            if rng.random() < 0.7
        }
        fields["_m"] = f"{newest}:0"
        r.hset(slice_hash_key("txn_count", encode_key([f"c{c}"])), mapping=fields)
    return now


def test_fast_path_answers_what_the_batch_endpoint_answers(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    now = _seed(r, 20)
    api = TestClient(create_app(make_config(redis_url, tmp_path), r, history=False))
    rng = random.Random(11)
    for _ in range(60):
        q = {"metric": "txn_count", "key": [f"c{rng.randrange(25)}"],
             "window": rng.choice(["10s", "1m", "95s", "5m", "10m"]),
             "end": now - rng.randrange(0, 120_000)}  # fmt: skip
        got = api.get(
            f"/v1/metrics/{q['metric']}",
            params={"key": q["key"], "window": q["window"], "end": q["end"]},
        )
        assert got.status_code == 200 and got.headers["content-type"] == "application/json"
        (want,) = api.post("/v1/query", json={"queries": [q]}).json()["results"]
        assert got.json() == want


def test_fast_path_alone_answers_a_lookup_and_passes_errors_on(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """With an inner application that records what reaches it: a good lookup never does, a bad
    one (unknown metric, bad window) and any other route always do."""
    now = _seed(r, 3)
    cfg = make_config(redis_url, tmp_path)
    engine = QueryEngine(cfg, r)
    reached: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fast = FastLookups(inner, engine, AsyncClients(r))

    async def call(path: str, query: bytes) -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        await fast(_scope(path, query), receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def scenario() -> None:
        status, body = await call("/v1/metrics/txn_count", f"key=c1&window=1m&end={now}".encode())
        assert status == 200 and reached == []
        answer = orjson.loads(body)
        assert answer["metric"] == "txn_count" and answer["key"] == ["c1"]
        assert answer == engine.run([engine.lookup("txn_count", ["c1"], "1m", str(now))])[0]
        for path, query in [
            ("/v1/metrics/nope", b"key=c1&window=1m"),
            ("/v1/metrics/txn_count", b"key=c1&window=soon"),
            ("/v1/metrics/txn_count", b"window=1m"),
            ("/v1/metrics/txn_count/series", b"key=c1&window=1m"),
        ]:
            assert (await call(path, query))[0] == 599
        assert reached == [
            "/v1/metrics/nope", "/v1/metrics/txn_count", "/v1/metrics/txn_count",
            "/v1/metrics/txn_count/series",
        ]  # fmt: skip

    asyncio.run(scenario())


def test_fast_path_answers_a_redis_error_itself(redis_url: str, tmp_path: Path) -> None:
    """A Redis that cannot answer (here: nothing listens) is a 503 from the fast path, not
    passed on to the application, which would wait on Redis a second time (a frozen Redis took
    twice the socket timeout to answer)."""
    cfg = make_config(redis_url, tmp_path)
    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, socket_timeout=0.5)
    reached: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    fast = FastLookups(inner, QueryEngine(cfg, down), AsyncClients(down))

    async def call(scope: dict[str, Any], body: bytes) -> tuple[int, Any]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body}

        await fast(scope, receive, send)
        return sent[0]["status"], orjson.loads(b"".join(m.get("body", b"") for m in sent[1:]))

    async def scenario() -> None:
        status, answer = await call(_scope("/v1/metrics/txn_count", b"key=c1&window=1m"), b"")
        assert status == 503 and answer["error"]["code"] == "unavailable", answer
        batch = {**_scope("/v1/query", b""), "method": "POST"}
        body = orjson.dumps({"queries": [{"metric": "txn_count", "key": "c1", "window": "1m"}]})
        status, answer = await call(batch, body)
        assert status == 503 and answer["error"]["code"] == "unavailable", answer
        assert reached == []

    asyncio.run(scenario())


def test_fast_path_keeps_the_bearer_token_and_the_latency_histogram(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    _seed(r, 2)
    cfg = make_config(redis_url, tmp_path, server={"token": "s3cret"})
    api = TestClient(create_app(cfg, r, history=False))
    params = {"key": "c1", "window": "1m"}
    assert api.get("/v1/metrics/txn_count", params=params).status_code == 401
    ok = api.get("/v1/metrics/txn_count", params=params, headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["value"] is not None
    text = api.get("/metrics").text
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("sluice_http_request_duration_seconds_count")
        and 'route="/v1/metrics/{name}"' in x
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_batch_fast_path_answers_alone_and_replays_the_body_it_passes_on(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A well-typed batch never reaches the inner application and gets what the engine answers;
    a bad one (unknown metric, bad window, lax types, bad JSON) reaches it with the very body the
    client sent, in the chunks it sent them."""
    now = _seed(r, 3)
    cfg = make_config(redis_url, tmp_path)
    engine = QueryEngine(cfg, r)
    reached: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        reached.append(body)
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fast = FastLookups(inner, engine, AsyncClients(r))

    async def post(chunks: list[bytes]) -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []
        todo = list(chunks)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": todo.pop(0), "more_body": bool(todo)}

        await fast(_scope("/v1/query", method="POST"), receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def scenario() -> None:
        queries = [{"metric": "txn_count", "key": [f"c{i}"], "window": "1m", "end": now}
                   for i in range(4)]  # fmt: skip
        body = orjson.dumps({"queries": queries})
        status, answer = await post([body[:10], body[10:30], body[30:]])
        assert status == 200 and reached == []
        want = engine.run([engine.lookup(q["metric"], q["key"], q["window"], now) for q in queries])
        assert orjson.loads(answer) == {"results": want}
        bad = [
            {"queries": [{"metric": "nope", "key": "c1", "window": "1m"}]},
            {"queries": [{"metric": "txn_count", "key": "c1", "window": "soon"}]},
            {"queries": [{"metric": "txn_count", "key": "c1", "window": "1m", "end": str(now)}]},
        ]
        for doc in bad:
            raw = orjson.dumps(doc)
            assert await post([raw[:7], raw[7:]]) == (599, b"")
            assert reached[-1] == raw
        assert await post([b"{not json"]) == (599, b"")
        assert reached[-1] == b"{not json"

    asyncio.run(scenario())


def test_batch_fast_path_agrees_with_the_full_application(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Over HTTP: a lax body the fast path passes on (a string `end`) gets the same answer as
    its well-typed twin, and errors keep their status and the `queries[i]` in their message."""
    now = _seed(r, 5)
    api = TestClient(create_app(make_config(redis_url, tmp_path), r, history=False))
    q = {"metric": "txn_count", "key": ["c2"], "window": "5m", "end": now}
    fast = api.post("/v1/query", json={"queries": [q, q]})
    lax = api.post("/v1/query", json={"queries": [q, {**q, "end": str(now)}]})
    assert fast.status_code == lax.status_code == 200
    assert fast.json() == lax.json()
    wrong = api.post("/v1/query", json={"queries": [q, {**q, "window": "soon"}]})
    assert wrong.status_code == 400 and "queries[1]" in wrong.json()["error"]["message"]
    unknown = api.post("/v1/query", json={"queries": [{**q, "metric": "nope"}]})
    assert unknown.status_code == 404
    typed = api.post("/v1/query", json={"queries": [{**q, "key": [1]}]})
    assert typed.status_code == 400


def test_the_server_freezes_what_it_built_at_start(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Long-lived objects are moved out of the cyclic collector's way once the app is up (its
    full collections made the latency's tail); requests still work after it."""
    gc.unfreeze()
    try:
        app = create_app(make_config(redis_url, tmp_path), r, history=False)
        with TestClient(app) as api:
            assert gc.get_freeze_count() > 1000
            got = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m"})
            assert got.status_code == 200
    finally:
        gc.unfreeze()


def test_a_key_as_long_as_the_fold_takes_is_looked_up(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """`source.max_string_bytes` bounds a key value in the fold and in a lookup alike, in UTF-8
    bytes: a 5,000-character key folded under 8192 could not be looked up (a fixed 4096
    characters)."""
    cfg = make_config(redis_url, tmp_path)
    source = cfg.source.model_copy(update={"max_string_bytes": 8192})
    cfg = cfg.model_copy(update={"source": source})
    newest = time.time_ns() // 1_000_000 // 10_000 * 10_000
    long_key = "k" * 5000
    r.hset(slice_hash_key("txn_count", encode_key([long_key])),
           mapping={str(newest): "1:4", "_m": f"{newest}:0"})  # fmt: skip
    api = TestClient(create_app(cfg, r))
    for how in ("get", "post"):
        if how == "get":
            resp = api.get("/v1/metrics/txn_count", params={"key": long_key, "window": "1m"})
        else:
            body = {"queries": [{"metric": "txn_count", "key": long_key, "window": "1m"}]}
            resp = api.post("/v1/query", json=body)
        assert resp.status_code == 200, resp.text
        got = resp.json() if how == "get" else resp.json()["results"][0]
        assert got["value"] == 4, got
    for too_long in ("k" * 8193, "é" * 4097):  # 8193 and 8194 bytes
        resp = api.get("/v1/metrics/txn_count", params={"key": too_long, "window": "1m"})
        assert resp.status_code == 400, resp.text
        assert "longer than 8192 bytes in UTF-8" in resp.json()["error"]["message"]
