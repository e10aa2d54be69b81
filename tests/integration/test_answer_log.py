"""The sample of served answers (`server.log_answers`) against real Redis: every path that answers
a lookup (the GET and batch fast paths, the FastAPI routes, the sync engine) logs exactly the
answer it gave; the sample is chosen per key by crc32, the same keys on every request; the
stream stays bounded; and logging never fails a request."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from sluice.clock import ManualClock
from sluice.query.answers import AnswerLog, sampled
from sluice.query.engine import Lookup, QueryEngine
from sluice.redis.keys import ANSWERS_KEY, encode_key, slice_hash_key
from sluice.server.app import create_app
from tests.conftest import make_config, wait_until

NOW = 1_764_358_800_000  # 2025-11-28 19:40 UTC, a slice boundary


@pytest.fixture(autouse=True)
def _unfreeze() -> Iterator[None]:
    """The app's lifespan freezes the garbage collector's objects; give them back after."""
    yield
    gc.unfreeze()


def _entries(r: redis.Redis) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in fields.items()} for _, fields in r.xrange(ANSWERS_KEY)
    ]


def _entry(answer: dict[str, Any], served_ms: int = NOW) -> dict[str, str]:
    """The stream entry a served answer must have become."""
    return {
        "metric": answer["metric"],
        "key": orjson.dumps(answer["key"]).decode(),
        "window_ms": str(answer["end"] - answer["start"]),
        "end_ms": str(answer["end"]),
        "value": orjson.dumps(answer["value"]).decode(),
        "covered_start": str(answer["covered_start"]),
        "covered_end": str(answer["covered_end"]),
        "served_ms": str(served_ms),
    }


def _logged(r: redis.Redis, n: int) -> None:
    """Wait for the answers stream to hold `n` entries (they are written without waiting)."""
    wait_until(lambda: r.xlen(ANSWERS_KEY) >= n, 10, f"{n} logged answers")


def _last_key(r: redis.Redis) -> str | None:
    newest = r.xrevrange(ANSWERS_KEY, count=1)
    return newest[0][1][b"key"].decode() if newest else None


def _app(r: redis.Redis, redis_url: str, tmp_path: Path, rate: float, keep: int = 10_000) -> Any:
    cfg = make_config(redis_url, tmp_path, server={"log_answers": rate, "log_answers_max": keep})
    return create_app(cfg, r, clock=ManualClock(NOW), history=False)


def test_every_answer_is_logged_at_rate_one(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    r.hset(
        slice_hash_key("txn_count", encode_key(["c1"])),
        mapping={str(NOW - 10_000): "1:3", str(NOW - 20_000): "1:2", "_m": f"{NOW - 10_000}:0"},
    )
    app = _app(r, redis_url, tmp_path, 1.0)
    want: list[dict[str, str]] = []
    with TestClient(app) as fast, TestClient(app.api) as full:  # full: FastAPI alone
        got = fast.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m"}).json()
        assert got["value"] == 5
        want.append(_entry(got))
        _logged(r, len(want))
        got = full.get("/v1/metrics/amount_q", params={"key": "m1", "window": "5m"}).json()
        assert got["value"] == {"0.5": None, "0.99": None}  # a dict, with no data
        want.append(_entry(got))
        _logged(r, len(want))
        queries = [
            {"metric": "avg_ticket", "key": "m|1", "window": "1h", "end": NOW - 5},
            {"metric": "pair_count", "key": ["c{1}", "m%2"], "window": "2h"},
        ]
        for client in (fast, full):  # full: the routes' POST /v1/query
            results = client.post("/v1/query", json={"queries": queries}).json()["results"]
            assert [a["value"] for a in results] == [None, 0]
            want += [_entry(a) for a in results]
            _logged(r, len(want))
        # Refused lookups and chart series are not answers to log.
        assert fast.get("/v1/metrics/nope", params={"key": "c1", "window": "1m"}).status_code == 404
        assert fast.get("/v1/metrics/txn_count", params={"window": "1m"}).status_code == 400
        series = fast.get("/v1/metrics/txn_count/series", params={"key": "c1", "window": "1m"})
        assert series.status_code == 200
        # One more answer: on the same connection, it is written after all those before it.
        want.append(_entry(fast.get("/v1/metrics/txn_count?key=c2&window=10s").json()))
        _logged(r, len(want))
    assert _entries(r) == want


def test_nothing_is_logged_at_rate_zero(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    app = _app(r, redis_url, tmp_path, 0.0)
    assert app.api.state.engine.answer_log is None
    with TestClient(app) as api:
        for key in ("c1", "c2", "c3"):
            assert api.get(f"/v1/metrics/txn_count?key={key}&window=1m").status_code == 200
        query = {"metric": "txn_count", "key": "c4", "window": "1m"}
        assert api.post("/v1/query", json={"queries": [query]}).status_code == 200
    assert not r.exists(ANSWERS_KEY)


def test_the_sample_is_the_keys_hashed_under_the_rate_on_every_request(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Keys that need escaping (`|`, `%`, braces) hash their encoded form, as the rule says."""
    keys = [[f"c{i}"] for i in range(60)] + [["a|b"], ["50%"], ["{x}"], ["%7C"], ["é"]]
    queries = [{"metric": "txn_count", "key": k, "window": "1m"} for k in keys]
    pairs = [["a|b", "c"], ["a", "b|c"], ["x", "y"], ["p%", "{q}"]]
    pairs += [[f"c{i}", "m"] for i in range(20)]
    queries += [{"metric": "pair_count", "key": k, "window": "1h"} for k in pairs]
    want = sorted(
        (q["metric"], orjson.dumps(q["key"]).decode())
        for q in queries
        if sampled(q["metric"], encode_key(q["key"]), 0.3)
    )
    assert 10 < len(want) < len(queries) - 10
    with TestClient(_app(r, redis_url, tmp_path, 0.3)) as api:
        for _ in range(2):
            assert api.post("/v1/query", json={"queries": queries}).status_code == 200
        for q in queries[:10]:  # one by one, through the GET fast path
            params = {"key": q["key"], "window": q["window"]}
            assert api.get("/v1/metrics/txn_count", params=params).status_code == 200
        firsts = {orjson.dumps(q["key"]).decode() for q in queries[:10]}
        once = [w for w in want if w[1] in firsts]
        _logged(r, 2 * len(want) + len(once))
    assert sorted((e["metric"], e["key"]) for e in _entries(r)) == sorted(want * 2 + once)


@given(st.lists(st.text("ab|%{}7C", max_size=4), min_size=1, max_size=3))
def test_pick_hashes_the_encoded_key(key: list[str]) -> None:
    """The hot path skips `encode_key` for keys that need no escaping; it decides alike."""
    lookup = Lookup("m", tuple(key), 60_000, NOW)
    answer = {"value": 0, "covered_start": 0, "covered_end": 0}
    picked = AnswerLog(0.3, 10, ManualClock(NOW)).pick([lookup], [answer])
    assert bool(picked) == sampled("m", encode_key(key), 0.3)


def test_the_stream_stays_bounded(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    node = int(r.config_get("stream-node-max-entries")["stream-node-max-entries"])
    queries = [{"metric": "txn_count", "key": f"c{i}", "window": "1m"} for i in range(200)]
    with TestClient(_app(r, redis_url, tmp_path, 1.0, keep=50)) as api:
        for _ in range(4):
            assert api.post("/v1/query", json={"queries": queries}).status_code == 200
        # On the same connection, the answer to this one is logged after all those before it.
        assert api.get("/v1/metrics/txn_count?key=last&window=1m").status_code == 200
        wait_until(lambda: _last_key(r) == '["last"]', 10, "the last answer logged")
    assert 50 <= r.xlen(ANSWERS_KEY) <= 50 + node  # MAXLEN ~: whole nodes are trimmed


def test_the_sync_engine_logs_after_its_answer_and_series_do_not(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path)
    clock = ManualClock(NOW)
    engine = QueryEngine(cfg, r, clock, AnswerLog(1.0, 100, clock))
    (answer,) = engine.run([engine.lookup("card_min", ["c1"], "10m")])
    assert _entries(r) == [_entry(answer)]
    engine.series("txn_count", ["c1"], "1m")
    QueryEngine(cfg, r, clock).query("txn_count", ["c1"], "1m")  # the CLI's: no log
    assert r.xlen(ANSWERS_KEY) == 1


def test_logging_never_fails_a_request(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """With the stream's key holding a string, every XADD fails: the answers still go out."""
    r.set(ANSWERS_KEY, "not a stream")
    cfg = make_config(redis_url, tmp_path)
    clock = ManualClock(NOW)
    engine = QueryEngine(cfg, r, clock, AnswerLog(1.0, 100, clock))
    assert engine.query("txn_count", ["c1"], "1m")["value"] == 0
    with TestClient(_app(r, redis_url, tmp_path, 1.0)) as api:
        for _ in range(3):
            got = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m"})
            assert got.status_code == 200 and got.json()["value"] == 0
        query = {"metric": "txn_count", "key": "c1", "window": "1m"}
        assert api.post("/v1/query", json={"queries": [query]}).status_code == 200
    assert r.get(ANSWERS_KEY) == b"not a stream"
