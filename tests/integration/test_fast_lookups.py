"""The `GET /v1/metrics/{name}` fast path against real Redis: it answers exactly what the batch
endpoint answers, alone; everything else (errors, other routes) reaches the full application."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from fastapi.testclient import TestClient

from sluice.query.app import AsyncClients, create_app
from sluice.query.engine import QueryEngine
from sluice.query.fast import FastLookups, parse_lookup
from sluice.redis.keys import encode_key, slice_hash_key
from tests.conftest import make_config


def _scope(path: str, query: bytes = b"", method: str = "GET") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": query, "headers": []}


@pytest.mark.parametrize(
    ("path", "query", "method", "parsed"),
    [
        ("/v1/metrics/txn_count", b"key=c1&window=5m", "GET", ("txn_count", ["c1"], "5m", None)),
        ("/v1/metrics/avg", b"key=a&key=b%20c&window=1h&end=9", "GET",
         ("avg", ["a", "b c"], "1h", "9")),
        ("/v1/metrics/x", b"window=1m&window=2m&other=1", "GET", ("x", [], "2m", None)),
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
