"""The HTTP API against real Redis: contract shapes, every error status, ingest, auth.

Most tests use Starlette's in-process transport; one runs the real server over a socket."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import yaml
from fastapi.testclient import TestClient

from sluice.errors import BadQuery, UnknownMetric
from sluice.query.client import Client
from sluice.redis.connection import open_redis
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.server.app import create_app
from tests.conftest import ServerThread, free_port, make_config


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _seed(r: redis.Redis) -> tuple[int, int]:
    """Two 10s slices of txn_count for card c1, as the writer stores them, ending now.

    Returns (now, newest slice start)."""
    now = _now_ms()
    newest = now // 10_000 * 10_000
    key = slice_hash_key("txn_count", encode_key(["c1"]))
    r.hset(key, mapping={str(newest): "1:3", str(newest - 10_000): "1:2", "_m": f"{newest}:0"})
    return now, newest


@pytest.fixture
def seeded(r: redis.Redis) -> tuple[int, int]:
    return _seed(r)


@pytest.fixture
def api(r: redis.Redis, redis_url: str, tmp_path: Path, seeded: tuple[int, int]) -> TestClient:
    return TestClient(create_app(make_config(redis_url, tmp_path), r))


def _error(resp: httpx.Response, status: int, word: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"code", "message"}
    assert word in err["message"], err
    return err


def test_metric_lookup_shape(api: TestClient, seeded: tuple[int, int]) -> None:
    now, newest = seeded
    resp = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "15s", "end": now})
    assert resp.status_code == 200
    body = resp.json()
    assert body == {
        "metric": "txn_count",
        "key": ["c1"],
        "value": 5 if now - 15_000 < newest else 3,
        "start": now - 15_000,
        "end": now,
        "covered_start": (now - 15_000 + 1) // 10_000 * 10_000,
        "covered_end": newest + 10_000,
    }


def test_end_defaults_to_now(api: TestClient) -> None:
    body = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m"}).json()
    assert abs(body["end"] - time.time_ns() // 1_000_000) < 5_000
    assert body["value"] == 5


def test_error_statuses_name_the_parameter(api: TestClient) -> None:
    _error(api.get("/v1/metrics/nope", params={"key": "c1", "window": "1m"}), 404, "nope")
    _error(api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "soon"}), 400, "window")
    _error(api.get("/v1/metrics/txn_count", params={"key": "c1"}), 400, "window")
    _error(api.get("/v1/metrics/txn_count", params={"window": "1m"}), 400, "key")
    _error(api.get("/v1/metrics/txn_count", params={"key": ["a", "b"], "window": "1m"}), 400, "key")
    _error(
        api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m", "end": "x"}),
        400,
        "end",
    )
    _error(api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "2d"}), 422, "retention")
    _error(api.get("/v1/metrics/pair_count", params={"key": "c1", "window": "1m"}), 400, "key")
    # A key whose percent-decoded bytes are not UTF-8 is no key (read leniently, it would be
    # another one, with U+FFFD in it); a key with U+FFFD itself, sent as UTF-8, is one.
    for path in ("/v1/metrics/txn_count", "/v1/metrics/txn_count/series"):
        _error(api.get(f"{path}?key=%FF&window=1m"), 400, "`key` is not UTF-8")
    assert api.get("/v1/metrics/txn_count?key=%EF%BF%BD&window=1m").status_code == 200
    # A parameter of one value given twice is refused, not answered for one of them.
    for query, param in [("window=1h&window=2h", "window"), ("window=1h&end=1&end=2", "end")]:
        _error(api.get(f"/v1/metrics/txn_count?key=c1&{query}"), 400, f"`{param}` is given more")
    _error(api.get("/v1/metrics/txn_count?key=c1&window=1h&%77indow=2h"), 400, "`window`")
    series = "/v1/metrics/txn_count/series?key=c1&window=1h&step=1m&%73tep=2m"
    _error(api.get(series), 400, "`step` is given more than once")
    # `step` is no parameter of a lookup: ignored there, on either path, however often
    assert api.get("/v1/metrics/txn_count?key=c1&window=1h&step=1&step=2").status_code == 200
    # A window within the retention's length that starts before it (an old `end`): its older
    # slices are removed, so it is refused, not answered short; one that starts within is not.
    day = 86_400_000
    old = time.time_ns() // 1_000_000 - day // 2
    resp = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "23h", "end": old})
    err = _error(resp, 422, "`end`")
    assert "before the retention of 'txn_count' (1d back from now)" in err["message"], err
    batch = api.post("/v1/query", json={"queries": [
        {"metric": "txn_count", "key": ["c1"], "window": "23h", "end": old}]})  # fmt: skip
    _error(batch, 422, "retention")
    ok = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "11h", "end": old})
    assert ok.status_code == 200, ok.text
    # An `end` in epoch seconds is far before the retention: the message says what it looks like.
    seconds = time.time_ns() // 1_000_000_000
    resp = api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m", "end": seconds})
    assert "looks like seconds" in _error(resp, 422, "`end` is in epoch milliseconds")["message"]
    assert "looks like seconds" not in err["message"], err


def test_batch_query_and_definitions(api: TestClient, seeded: tuple[int, int]) -> None:
    now = seeded[0]
    resp = api.post(
        "/v1/query",
        json={
            "queries": [
                {"metric": "txn_count", "key": ["c1"], "window": "1m", "end": now},
                {"metric": "txn_count", "key": ["c2"], "window": "1m", "end": now},
                {"metric": "avg_ticket", "key": ["m1"], "window": "5m"},
            ]
        },
    )
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert [x["value"] for x in results] == [5, 0, None]
    _error(api.post("/v1/query", json={"queries": [{"metric": "txn_count"}]}), 400, "queries[0]")
    _error(api.post("/v1/query", json={"q": []}), 400, "queries")
    query = {"metric": "txn_count", "key": [["c1"]], "window": "1m"}
    err = _error(api.post("/v1/query", json={"queries": [query]}), 400, "queries[0].key[0]")
    assert err["message"].startswith("`queries[0].key[0]`: Input should be a valid string"), err
    for end in (True, 1.5):  # an epoch ms is an integer (or its text), never a boolean
        query = {"metric": "txn_count", "key": ["c1"], "window": "1m", "end": end}
        _error(api.post("/v1/query", json={"queries": [query]}), 400, "queries[0].end")
    for end, says in ((1e30, "1e+30 is out of range"), (1.5, "a whole number; got 1.5")):
        query = {"metric": "txn_count", "key": ["c1"], "window": "1m", "end": end}
        err = _error(api.post("/v1/query", json={"queries": [query]}), 400, "queries[0].end")
        assert says in err["message"], err
    bad = _error(
        api.post("/v1/query", content=b"{not json", headers={"content-type": "application/json"}),
        400,
        "not valid JSON",
    )
    why = "Expecting property name enclosed in double quotes"  # the parser's, not a dict's text
    assert bad["message"] == f"body is not valid JSON: {why}", bad
    names = [m["name"] for m in api.get("/v1/metrics").json()["metrics"]]
    assert names[0] == "txn_count" and "avg_ticket" in names


def test_a_batch_is_json_whatever_its_content_type_says(
    api: TestClient, seeded: tuple[int, int]
) -> None:
    """`curl -d` sends a batch as form data. The fast path reads it as JSON; its errors, and a
    batch too large for the fast path, are read as JSON too, by the full application."""
    now = seeded[0]
    form = {"content-type": "application/x-www-form-urlencoded"}

    def post(*queries: dict[str, Any], headers: dict[str, str] = form) -> httpx.Response:
        return api.post("/v1/query", content=orjson.dumps({"queries": list(queries)}),
                        headers=headers)  # fmt: skip

    ok = {"metric": "txn_count", "key": ["c1"], "window": "1m", "end": now}
    assert post(ok).json()["results"][0]["value"] == 5
    _error(post({**ok, "metric": "nope"}), 404, "nope")
    _error(post({**ok, "window": "5d"}), 422, "retention")
    _error(post({**ok, "window": "1x"}), 400, "window")
    # Over the fast path's 1 MiB: 300 lookups of keys of 4,000 characters, one of them c1's.
    big = [{**ok, "key": ["k" * 4000]} for _ in range(299)] + [ok]
    for headers in (form, {}):
        resp = post(*big, headers=headers)
        assert resp.status_code == 200, resp.text
        values = [x["value"] for x in resp.json()["results"]]
        assert values[-1] == 5 and set(values[:-1]) == {0}


def test_a_lone_surrogate_in_a_batch_is_a_bad_request(api: TestClient) -> None:
    """`"\\ud800"` is JSON that Python's parser reads into a string with no UTF-8 bytes: a 400
    naming it, as `key=%FF` is on the GET path, not a 500 where the key is sent to Redis."""
    for field, value in (("key", ["\\ud800"]), ("key", "\\udfff"), ("metric", "\\ud800")):
        query = {"metric": "txn_count", "key": ["c1"], "window": "1m", field: value}
        body = orjson.dumps({"queries": [query]}).replace(b"\\\\u", b"\\u")
        for headers in ({"content-type": "application/json"}, {}):
            resp = api.post("/v1/query", content=body, headers=headers)
            _error(resp, 400, f"queries[0].{field}")


def test_ingest_json_array_and_ndjson(api: TestClient, r: redis.Redis) -> None:
    now = _now_ms()
    events = [
        {"ts": now, "card": f"c{i}", "merchant": "m", "amount": 1.5, "qty": 2} for i in range(5)
    ]
    assert api.post("/v1/events", json=events).json() == {"accepted": 5}
    ndjson = b"\n".join(httpx.Request("POST", "/", json=e).content for e in events) + b"\n"
    resp = api.post("/v1/events", content=ndjson, headers={"content-type": "application/x-ndjson"})
    assert resp.status_code == 202 and resp.json() == {"accepted": 5}
    bom = b"\xef\xbb\xbf"  # a byte-order mark, as some Windows tools write: either form
    assert api.post("/v1/events", content=bom + orjson.dumps(events[:2])).json()["accepted"] == 2
    assert api.post("/v1/events", content=bom + ndjson).json() == {"accepted": 5}
    stored = sum(int(f[b"n"]) for s in ("events:0", "events:1") for _, f in r.xrange(s))
    assert stored == 17
    assert not r.keys("sluice:produced:*")  # a request's producer leaves no marks behind
    _error(api.post("/v1/events", content=b""), 400, "empty")
    _error(api.post("/v1/events", content=b"[1, 2]"), 400, "not a JSON object")
    _error(api.post("/v1/events", content=b'{"a": 1}\n{oops'), 400, "line 2")


def test_unknown_paths_and_methods_answer_in_the_error_shape(api: TestClient) -> None:
    """Routing's own refusals carry `{"error": {"code", "message"}}` like every other error."""
    assert _error(api.get("/v1/nothing"), 404, "/v1/nothing")["code"] == "not_found"
    for method, path in [("GET", "/v1/query"), ("POST", "/v1/metrics/txn_count"),
                         ("GET", "/v1/events")]:  # fmt: skip
        resp = api.request(method, path)
        err = _error(resp, 405, f"{method} is not allowed on {path}")
        assert err["code"] == "method_not_allowed" and resp.headers["allow"], resp.headers
    # The ingest endpoint's refusals use the same code as the other endpoints' bad requests.
    assert _error(api.post("/v1/events", content=b""), 400, "empty")["code"] == "bad_request"


def test_head_answers_as_get_without_a_body(api: TestClient, seeded: tuple[int, int]) -> None:
    """Monitors probe with HEAD: the GET's status and headers, no body, on every GET path (the
    fast lookups' too); a path that takes no GET still refuses it."""
    now, _ = seeded
    lookup = ("/v1/metrics/txn_count", {"key": "c1", "window": "15s", "end": now})
    for path, params in [("/healthz", {}), lookup, ("/v1/metrics", {}), ("/v1/status", {})]:
        got, head = api.get(path, params=params), api.head(path, params=params)
        assert got.status_code == head.status_code == 200, (path, head.status_code)
        assert head.content == b"" and got.content, path
        assert head.headers["content-length"] == str(len(got.content)), path
        assert head.headers["content-type"] == got.headers["content-type"], path
    assert api.head("/v1/metrics/nothing", params={"key": "c1"}).status_code == 404
    refused = api.head("/v1/query")
    assert refused.status_code == 405 and refused.content == b"", refused.headers
    assert refused.headers["allow"] == "POST", refused.headers


def test_oversize_body_is_refused(api: TestClient, r: redis.Redis) -> None:
    """Declared too long, or sent in chunks with no length and found too long as it is read
    (not read whole first): 413 either way, on any route that takes a body."""
    big = b"[" + b" " * (11 * 1024 * 1024) + b"]"
    _error(api.post("/v1/events", content=big), 413, "over")

    def chunks() -> Any:
        yield b'[{"ts": 1, "card": "c"}'
        for _ in range(11):
            yield b" " * (1024 * 1024)
        yield b"]"

    before = sum(r.xlen(k) for k in r.scan_iter("events*"))
    for path in ("/v1/events", "/v1/query"):
        resp = api.post(path, content=chunks())
        assert "content-length" not in resp.request.headers
        assert _error(resp, 413, "over")["code"] == "too_large"
    assert sum(r.xlen(k) for k in r.scan_iter("events*")) == before


def test_bearer_token(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path, server={"token": "s3cret"})
    api = TestClient(create_app(cfg, r))
    _error(api.get("/v1/metrics"), 401, "token")
    _error(api.get("/v1/metrics", headers={"authorization": "Bearer wrong"}), 401, "token")
    assert api.get("/v1/metrics", headers={"authorization": "Bearer s3cret"}).status_code == 200
    # The scheme is case-insensitive (RFC 9110); the token is not.
    assert api.get("/v1/metrics", headers={"authorization": "bearer s3cret"}).status_code == 200
    _error(api.get("/v1/metrics", headers={"authorization": "Bearer S3CRET"}), 401, "token")
    assert api.get("/healthz").status_code == 200  # health stays open for probes


def test_status_health_and_prometheus(api: TestClient) -> None:
    status = api.get("/v1/status").json()
    assert status["backlog"]["entries"] == 0
    assert api.get("/healthz").json() == {
        "status": "ok",
        "redis": "ok",
        "pipeline": "not_running",
        "processes": [],
    }
    text = api.get("/metrics").text
    assert "sluice_backlog_entries 0.0" in text
    assert "<title>Sluice</title>" in api.get("/").text


def test_healthz_is_503_while_the_pipeline_keeps_failing(
    api: TestClient, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    from sluice.clock import SYSTEM_CLOCK
    from sluice.pipeline.health import FAILING_AFTER, Health
    from sluice.pipeline.lease import Claim, Lease

    lease = Lease(r, [Claim("spark", tmp_path / "c")], 60_000, SYSTEM_CLOCK)
    assert lease.try_acquire() is None  # the leader's: it keeps its lease while it restarts
    health = Health(r, SYSTEM_CLOCK, leased=True)
    for i in range(FAILING_AFTER - 1):
        health.failed(f"boom {i}")
    body = api.get("/healthz").json()
    assert body["pipeline"] == "restarting"
    health.failed("redis went away")
    resp = api.get("/healthz")
    assert resp.status_code == 503
    assert "3 times in a row" in resp.json()["error"]["message"]
    assert "redis went away" in resp.json()["error"]["message"]
    status = api.get("/v1/status").json()["pipeline"]
    assert status["state"] == "failing" and status["consecutive_failures"] == FAILING_AFTER
    health.recovered()
    assert api.get("/healthz").json()["pipeline"] == "running"
    from sluice.source.waiting import LogState

    log_state = LogState(redis_url, "spark")
    log_state.waiting("no_topic", "topic 'pay' does not exist")  # as /v1/status says it
    assert api.get("/healthz").json()["pipeline"] == "waiting_for_log"
    assert api.get("/v1/status").json()["pipeline"]["state"] == "waiting_for_log"
    log_state.ok()
    assert api.get("/healthz").json()["pipeline"] == "running"
    lease.release()
    assert api.get("/healthz").json()["pipeline"] == "not_running"


def test_prometheus_exports_each_stage_flow_state(api: TestClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    now = time.time_ns() // 1_000_000
    body = [{"ts": now, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1}]
    assert api.post("/v1/events", json=body).status_code == 202  # the ingest task publishes
    families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    rates = {s.labels["stage"]: s.value for s in families["sluice_stage_rate"].samples}
    assert rates["ingest"] == float("inf")  # unthrottled
    flags = {s.labels["stage"]: s.value for s in families["sluice_stage_backpressure"].samples}
    assert flags["ingest"] == 0.0
    assert "sluice_stage_backpressure_ratio" in families
    assert families["sluice_backlog_bytes"].samples[0].value > 0  # the event just ingested


def test_redis_down_is_503(redis_url: str, tmp_path: Path) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    api = TestClient(create_app(make_config(redis_url, tmp_path), dead))
    _error(
        api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m"}), 503, "unavailable"
    )
    assert api.get("/healthz").status_code == 503


def test_a_store_error_no_retry_clears_is_500_not_503(r: redis.Redis, api: TestClient) -> None:
    """A slice key another program overwrote with a string answers WRONGTYPE on every try: a
    500 naming it, not a 503 that tells clients to retry. Both the single lookup and a batch."""
    r.set(slice_hash_key("txn_count", encode_key(["c1"])), "not a hash")
    params = {"key": "c1", "window": "1m"}
    err = _error(api.get("/v1/metrics/txn_count", params=params), 500, "WRONGTYPE")
    assert err["code"] == "store_error"
    batch = {"queries": [{"metric": "txn_count", "key": "c1", "window": "1m"}]}
    err = _error(api.post("/v1/query", json=batch), 500, "WRONGTYPE")
    assert err["code"] == "store_error"
    assert api.get("/v1/metrics/txn_count", params={**params, "key": "c2"}).status_code == 200


def test_a_redis_out_of_memory_is_503(r: redis.Redis, api: TestClient) -> None:
    """A real server's OOM reply (redis-py raises its own class and drops the code): a write
    refused now may be taken later, so 503, as for a server that is down."""
    now = time.time_ns() // 1_000_000
    body = [{"ts": now, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1}]
    r.config_set("maxmemory", "1")
    try:
        _error(api.post("/v1/events", json=body), 503, "maxmemory")
    finally:
        r.config_set("maxmemory", "0")
    assert api.post("/v1/events", json=body).status_code == 202


def test_python_client_over_a_real_socket(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    _seed(r)
    app = create_app(make_config(redis_url, tmp_path), r)
    with ServerThread(app) as server, Client(server.url) as client:
        assert client.query("txn_count", "c1", "1m")["value"] == 5
        assert [
            x["value"]
            for x in client.query_many([{"metric": "txn_count", "key": ["c1"], "window": "1m"}])
        ] == [5]
        assert (
            client.send_events(
                [{"ts": _now_ms(), "card": "c9", "merchant": "m", "amount": 1.0, "qty": 1}]
            )
            == 1
        )
        assert "txn_count" in [m["name"] for m in client.metrics()]
        with pytest.raises(UnknownMetric, match="nope"):
            client.query("nope", "c1", "1m")
        with pytest.raises(BadQuery, match="retention"):
            client.query("txn_count", "c1", "30d")


def test_series_points_cover_their_steps(api: TestClient, seeded: tuple[int, int]) -> None:
    now, newest = seeded
    resp = api.get("/v1/metrics/txn_count/series", params={"key": "c1", "window": "1m", "end": now})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["step_ms"] == 10_000
    points = body["points"]
    assert [p["end"] - p["start"] for p in points] == [10_000] * len(points)
    assert points[-1] == {"start": newest, "end": newest + 10_000, "value": 3}
    assert points[-2]["value"] == 2
    assert sum(p["value"] for p in points) == 5
    coarse = api.get(
        "/v1/metrics/txn_count/series",
        params={"key": "c1", "window": "1m", "end": now, "step": "30s"},
    ).json()
    assert sum(p["value"] for p in coarse["points"]) == 5
    _error(
        api.get(
            "/v1/metrics/txn_count/series", params={"key": "c1", "window": "1m", "step": "15s"}
        ),
        400,
        "step",
    )
    _error(
        api.get(
            "/v1/metrics/txn_count/series", params={"key": "c1", "window": "1d", "step": "10s"}
        ),
        422,
        "points",
    )
    # Without a step, a window of over 1,000 slices gets a round step that fits: 2m for a day
    # of 10 s slices (720 points), and the same counts
    day = api.get(
        "/v1/metrics/txn_count/series", params={"key": "c1", "window": "1d", "end": now}
    ).json()
    assert day["step_ms"] == 120_000 and len(day["points"]) in (720, 721), day["step_ms"]
    assert sum(p["value"] for p in day["points"]) == 5


def test_openapi_spec_lists_the_contract(api: TestClient) -> None:
    spec = api.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {"/v1/metrics", "/v1/metrics/{name}", "/v1/metrics/{name}/series", "/v1/query"} <= paths
    assert "requestBody" in spec["paths"]["/v1/query"]["post"]
    # Errors are documented in the shape they are sent: {"error": {"code", "message"}}.
    answers = spec["paths"]["/v1/metrics/{name}"]["get"]["responses"]
    assert {"200", "400", "404", "422", "503"} <= set(answers), answers
    ref = answers["400"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ErrorBody") and "HTTPValidationError" not in spec["components"]["schemas"]


_SERVED = {
    "source": {"schema": {"ts": "long", "card": "string"}},
    "metrics": [
        {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1d"}
    ],
}


def _start_serve(cfg: Path, *args: str) -> tuple[subprocess.Popen[str], httpx.Response]:
    """`sluice serve -c cfg` in a process group of its own, and its first lookup's response
    (txn_count of c1 over 1m)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "serve", "-c", str(cfg), "--port", str(port), *args],
        start_new_session=True, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            resp = httpx.get(
                f"http://127.0.0.1:{port}/v1/metrics/txn_count",
                params={"key": "c1", "window": "1m"},
            )
            return proc, resp
        except httpx.TransportError:
            if time.monotonic() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"serve did not start: {proc.communicate()[1]}") from None
            time.sleep(0.2)


def _stop_serve(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> None:
    """Ctrl-C (or `sig`) to the whole process group: serve stops quietly (exit 0, no traceback,
    no error) and says so."""
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "ERROR" not in err, err
    assert "msg=stopped" in err.splitlines()[-1], err


@pytest.mark.parametrize("http", ["uvicorn", "granian"])
def test_serve_with_two_workers(r: redis.Redis, redis_url: str, tmp_path: Path, http: str) -> None:
    """`sluice serve --workers 2` on either HTTP server: both workers answer, every scrape holds
    both workers' latencies, and Ctrl-C (SIGINT to the whole process group) stops it quietly."""
    _seed(r)
    cfg = tmp_path / "sluice.yaml"
    cfg.write_text(yaml.safe_dump({"redis": redis_url, **_SERVED}))
    proc, resp = _start_serve(cfg, "--workers", "2", "--http", http)
    try:
        assert resp.json()["value"] == 5
        for _ in range(19):  # a new connection each: both workers answer some
            assert httpx.get(resp.url).status_code == 200
        head = httpx.head(resp.url.copy_with(path="/healthz", query=None))  # as monitors probe
        assert head.status_code == 200 and head.content == b"", head
        assert int(head.headers["content-length"]) > 0, head.headers
        # Every worker's latencies are in every scrape (the client's multiprocess mode).
        from prometheus_client.parser import text_string_to_metric_families

        for _ in range(4):
            text = httpx.get(resp.url.copy_with(path="/metrics", query=None)).text
            hist = next(
                f
                for f in text_string_to_metric_families(text)
                if f.name == "sluice_http_request_duration_seconds"
            )
            count = sum(
                s.value
                for s in hist.samples
                if s.name.endswith("_count") and s.labels["route"] == "/v1/metrics/{name}"
            )
            assert count == 20
        # The workers' samplers keep one shared history.
        status = resp.url.copy_with(path="/v1/status", query=b"history=5")
        deadline = time.monotonic() + 10
        while not httpx.get(status).json()["history"]:
            assert time.monotonic() < deadline, "no history sample"
            time.sleep(0.2)
    finally:
        _stop_serve(proc)


@pytest.mark.parametrize(("http", "workers"), [("uvicorn", "1"), ("granian", "2")])
def test_serve_on_the_embedded_redis_reads_it_over_its_unix_socket(http: str, workers: str) -> None:
    """With no `redis:` (the embedded default), `serve` joins the server under state_dir and
    its lookups go over the server's Unix socket, in one process or in workers."""
    short = Path(tempfile.mkdtemp(prefix="sluice-"))  # pytest's own paths may be too deep
    try:
        with open_redis(None, short / "state") as handle:
            _seed(handle.client)
            cfg = short / "sluice.yaml"
            cfg.write_text(yaml.safe_dump({"state_dir": str(short / "state"), **_SERVED}))
            proc, resp = _start_serve(cfg, "--workers", workers, "--http", http)
            try:
                assert resp.json()["value"] == 5
                over_socket = [c for c in handle.client.client_list() if "U" in c["flags"]]
                assert over_socket, handle.client.client_list()
            finally:
                _stop_serve(proc, signal.SIGTERM)  # as systemd or Kubernetes stop it
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_queries_survive_a_script_flush(api: TestClient, r: redis.Redis) -> None:
    params = {"key": "c1", "window": "1m"}
    assert api.get("/v1/metrics/txn_count", params=params).json()["value"] == 5
    r.script_flush()  # as after a Redis restart or failover: the server forgot the Lua scripts
    assert api.get("/v1/metrics/txn_count", params=params).json()["value"] == 5
