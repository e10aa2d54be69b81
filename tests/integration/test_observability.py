"""What the dashboard, Prometheus and `sluice status` read, against real Redis: the shared
per-second history, the freshness histogram, the exposition's families, the static assets,
and the status command's watch mode."""

from __future__ import annotations

import asyncio
import json
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
import redis
from click.testing import CliRunner
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from sluice.cli import main
from sluice.clock import ManualClock
from sluice.redis.keys import BATCHES_KEY, FRESHNESS_KEY, STATS_KEY
from sluice.redis.scripts import RECORD_BATCH, script_source
from sluice.server.app import create_app
from sluice.source.producer import Producer
from sluice.status.freshness import increments, read_histogram
from sluice.status.history import Sampler, read_history
from tests.conftest import make_config


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _produce(cfg: Any, r: redis.Redis, n: int) -> None:
    p = Producer.from_config(cfg, r, flow=False)
    p.send_many(
        {"ts": 1, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": 1} for i in range(n)
    )
    p.flush()


def test_samplers_share_one_history_and_it_carries_rates(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path)
    clock = ManualClock(time.time_ns() // 1_000_000 // 1000 * 1000)
    a, b = Sampler(r, cfg, clock), Sampler(r, cfg, clock)  # two API workers
    _produce(cfg, r, 100)
    assert a.sample_once() is True
    assert b.sample_once() is False  # that second is taken: one sample per second in all
    clock.advance(1000)
    _produce(cfg, r, 50)
    assert b.sample_once() is True
    history = read_history(r, 60)
    assert [s["produced"] for s in history] == [100, 150]
    assert history[1]["input_per_s"] == 50.0
    assert history[1]["backlog"]["entries"] == 4  # two flushes over two shards, not consumed
    assert set(history[1]["stages"]) == {"ingest", "spark", "store"}

    api = TestClient(create_app(cfg, r, clock=clock, history=False))
    body = api.get("/v1/status", params={"history": 60}).json()
    assert [s["t"] for s in body["history"]] == [s["t"] for s in history]
    assert "history" not in api.get("/v1/status").json()  # only when asked for
    resp = api.get("/v1/status", params={"history": "a lot"})
    assert resp.status_code == 400 and "`history`" in resp.json()["error"]["message"]


def test_freshness_histogram_counts_each_batch_once(r: redis.Redis) -> None:
    record = r.register_script(script_source(RECORD_BATCH))
    rec = orjson.dumps({"batch": 1})
    args = [7, rec, "batches", 1, "events_in", 10, "|", *increments(1_200)]
    assert record(keys=[STATS_KEY, BATCHES_KEY, FRESHNESS_KEY], args=args) == 1
    assert record(keys=[STATS_KEY, BATCHES_KEY, FRESHNESS_KEY], args=args) == 0  # a re-run
    h = read_histogram(r)
    assert h["count"] == 1 and h["sum_s"] == 1.2
    cumulative = dict(h["buckets"])
    assert cumulative[1.0] == 0 and cumulative[2.5] == 1 and cumulative[float("inf")] == 1
    assert r.hget(STATS_KEY, "events_in") == b"10"


def test_a_request_is_counted_before_its_answer_can_reach_the_client(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A client that scrapes `/metrics` once it has its answer (from another worker, which may
    run first) finds that request counted: the timer records it as the last body part is
    handed to the server. Here the scrape runs inside that very send, before any byte left."""
    app = create_app(make_config(redis_url, tmp_path), r, history=False)

    async def call(path: str, query: bytes, on_last: Any = None) -> bytes:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": [(b"host", b"t")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
        body = bytearray()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body") and on_last is not None:
                    await on_last()

        await app(scope, receive, send)
        return bytes(body)

    async def lookups_counted() -> float:
        fams = _families((await call("/metrics", b"")).decode())
        hist = fams["sluice_http_request_duration_seconds"]
        return sum(s.value for s in hist.samples if s.name.endswith("_count")
                   and s.labels["route"] == "/v1/metrics/{name}")  # fmt: skip

    seen: list[float] = []

    async def scrape() -> None:
        seen.append(await lookups_counted())

    async def run() -> None:
        for _ in range(3):
            answer = await call("/v1/metrics/txn_count", b"key=c1&window=1m", scrape)
            assert orjson.loads(answer)["metric"] == "txn_count", answer

    asyncio.run(run())
    assert seen == [1, 2, 3]


def test_prometheus_exposition(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path)
    api = TestClient(create_app(cfg, r))
    record = r.register_script(script_source(RECORD_BATCH))
    now = time.time_ns() // 1_000_000
    rec = {"batch": 3, "token": 3, "events": 5, "dead": 1, "started_ms": now - 400,
           "done_ms": now, "min_ems": now - 300, "max_ems": now - 100}  # fmt: skip
    record(
        keys=[STATS_KEY, BATCHES_KEY, FRESHNESS_KEY],
        args=[3, orjson.dumps(rec), "batches", 1, "events_in", 5, "events_aggregated", 4,
              "dead_letters", 1, "dead_bad_json", 1, "|", *increments(300)],
    )  # fmt: skip
    for _ in range(3):
        api.get("/v1/metrics/txn_count", params={"key": "c1", "window": "1m"})
    api.get("/v1/metrics/nope", params={"key": "c1", "window": "1m"})  # a 404 of a real route
    api.get("/no/such/path")  # no route: not recorded
    fams = _families(api.get("/metrics").text)
    hist = fams["sluice_http_request_duration_seconds"]
    counts = {
        (s.labels["method"], s.labels["route"]): s.value
        for s in hist.samples
        if s.name.endswith("_count")
    }
    assert counts[("GET", "/v1/metrics/{name}")] == 4
    assert not any("/no/such" in route for _, route in counts)
    fresh = fams["sluice_freshness_seconds"]
    assert fresh.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fresh.samples if s.name.endswith("_bucket")}
    assert buckets["0.25"] == 0 and buckets["0.5"] == 1 and buckets["+Inf"] == 1
    one = {name: fams[name].samples[0].value for name in fams if len(fams[name].samples) == 1}
    assert one["sluice_redis_up"] == 1 and one["sluice_redis_used_memory_bytes"] > 0
    assert one["sluice_events_in"] == 5 and one["sluice_batches"] == 1
    assert one["sluice_audit_balanced"] == 1
    dead = {s.labels["reason"]: s.value for s in fams["sluice_dead_letters"].samples}
    assert dead == {"bad_json": 1}
    state = {s.labels["state"]: s.value for s in fams["sluice_pipeline_state"].samples}
    assert state["not_running"] == 1 and sum(state.values()) == 1
    assert "sluice_backlog_entries 0.0" in api.get("/metrics").text  # the old names stay


def test_prometheus_answers_while_redis_is_down(redis_url: str, tmp_path: Path) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    api = TestClient(create_app(make_config(redis_url, tmp_path), dead))
    resp = api.get("/metrics")
    assert resp.status_code == 200
    fams = _families(resp.text)
    assert fams["sluice_redis_up"].samples[0].value == 0
    assert "sluice_backlog_entries" not in fams


def test_dashboard_assets_are_package_data_served_from_this_origin(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    api = TestClient(create_app(make_config(redis_url, tmp_path), r))
    page = api.get("/").text
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(ref.startswith(("/static/", "data:")) for ref in refs), refs
    static = resources.files("sluice.web") / "static"
    for name, ctype in (("app.js", "javascript"), ("chart.js", "javascript"),
                        ("style.css", "text/css")):  # fmt: skip
        resp = api.get(f"/static/{name}")
        assert resp.status_code == 200 and ctype in resp.headers["content-type"]
        assert resp.text == (static / name).read_text(encoding="utf-8")
        assert f"/static/{name}" in refs
        # No script or style of the page fetches anything from another origin.
        assert not re.search(r"""(?:fetch|import|url)\(\s*["']?(?:https?:)?//""", resp.text)
    assert api.get("/static/../app.py").status_code == 404


def test_status_watch_prints_a_block_per_interval(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    import yaml

    path = tmp_path / "sluice.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "redis": redis_url,
                "source": {"schema": {"ts": "long", "card": "string"}},
                "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count"}],
            }
        )
    )
    runner = CliRunner()
    args = ["status", "-c", str(path), "--watch", "--interval", "0.1", "--count", "3"]
    started = time.monotonic()
    out = runner.invoke(main, args)
    assert out.exit_code == 0, out.output
    assert time.monotonic() - started < 10
    assert out.output.count("--- ") == 3 and out.output.count("backlog (entries)") == 3
    assert "\x1b[" not in out.output  # not a terminal: blocks, no cursor movement
    out = runner.invoke(main, [*args, "--json"])
    lines = out.output.strip().splitlines()
    assert len(lines) == 3 and all("flow" in json.loads(line) for line in lines)
    out = runner.invoke(main, ["--log-level", "warning", "status", "-c", str(path)])
    assert out.exit_code == 0 and "events/s in / admitted / processed" in out.output
    for flag, value in (("--count", "3"), ("--interval", "0.5")):  # without --watch: said
        out = runner.invoke(main, ["status", "-c", str(path), flag, value])
        assert out.exit_code == 2 and f"{flag} applies only with --watch" in out.output
