"""Multi-stage pipelines on real Spark and Redis: stream-to-stream stages (filter, explode,
enrichment from a static table), a chain and branches, each reader with its own offsets, exact
answers at the end of every path, and exactly-once output when a batch is re-run."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from sluice.config import config_from_dict
from sluice.errors import ConfigError
from sluice.graph import graph_topology
from sluice.pipeline.run import Pipeline, build_queries
from sluice.pipeline.stage import StageQuery
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import dead_letter_stream_key, shard_side_key, stats_keys
from sluice.source.producer import Producer
from tests.conftest import config_data

CARDS = [f"c{i}" for i in range(12)]
TIERS = {c: ("gold" if i % 3 == 0 else "basic") for i, c in enumerate(CARDS)}


def stage_config(redis_url: str, tmp_path: Path) -> dict[str, Any]:
    tiers = tmp_path / "tiers.csv"
    tiers.write_text("card,tier\n" + "".join(f"{c},{t}\n" for c, t in TIERS.items()))
    data = config_data(redis_url, tmp_path / "state")
    data["source"] = {**data["source"], "format": "fields"}
    data["metrics"] = [
        {"name": "n", "key": ["card"], "agg": "count", "slice": "1m", "retention": "1d"},
        {"name": "big_n", "key": ["card"], "agg": "count", "slice": "1m", "retention": "1d",
         "from": "big"},
        {"name": "big_qty", "key": ["card"], "agg": "sum", "value": "qty", "slice": "1m",
         "retention": "1d", "from": "big"},
        {"name": "parts_qty", "key": ["card"], "agg": "sum", "value": "qty", "slice": "1m",
         "retention": "1d", "from": "parts"},
        {"name": "tier_n", "key": ["tier"], "agg": "count", "slice": "1m", "retention": "1d",
         "from": "tiered"},
    ]  # fmt: skip
    data["derived"] = []
    data["stages"] = [
        # a filter, and a chain behind it: each big event exploded into two parts
        {"name": "big", "from": "events", "sql": "SELECT * FROM input WHERE qty >= 5",
         "to": {"stream": "big", "entry_events": 7}},
        {"name": "parts", "from": "big",
         "sql": "SELECT ts, card, explode(array(qty, qty * 10)) AS qty FROM input",
         "to": {"stream": "parts", "shards": 2}},
        # a branch on the source: enrichment from a static table
        {"name": "tiered", "from": "events", "tables": {"tiers": str(tiers)},
         "sql": "SELECT i.ts, i.card, t.tier FROM input i JOIN tiers t ON i.card = t.card",
         "to": {"stream": "tiered"}},
    ]  # fmt: skip
    return data


def make_events(n: int, now: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    return [
        {"ts": now - rng.randrange(600_000), "card": rng.choice(CARDS),
         "merchant": "m", "amount": 1.5, "qty": rng.randrange(10)}
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(params=["redis", "cluster"])
def store(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """(url, client) of an emptied single Redis, or of a 3-master Redis Cluster."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url"), request.getfixturevalue("r")
    cluster = request.getfixturevalue("redis_cluster")
    return cluster.url, request.getfixturevalue("rc")


def test_chains_and_branches_answer_exactly(
    store: tuple[str, Any], spark: Any, tmp_path: Path
) -> None:
    redis_url, r = store
    cfg = config_from_dict(stage_config(redis_url, tmp_path))
    graph = graph_topology(cfg)
    now = int(time.time() * 1000)
    events = make_events(6000, now)
    producer = Producer.from_config(cfg, r, batch_events=500)
    for e in events:
        producer.send(e)
    producer.flush()
    # malformed input, in each shard (partition): each reader of `events` counts it as a dead
    # letter, and it is recorded once
    shards = cfg.source.shard_keys()
    for shard in shards:
        r.xadd(shard, {"ts": str(now), "card": "c1", "merchant": "m", "amount": "x", "qty": "1"})
    shard = shards[0]

    run = Pipeline(cfg, RedisHandle(redis_url), spark)
    thread = threading.Thread(target=run.run_forever, daemon=True)
    thread.start()
    try:
        stats = {s: stats_keys(s).stats for s in ("big", "parts", "tiered")}
        deadline = time.monotonic() + 180
        want_big = sum(1 for e in events if e["qty"] >= 5)
        while time.monotonic() < deadline:
            done = {s: int(r.hget(k, "events_out") or 0) for s, k in stats.items()}
            folded = int(r.hget(stats_keys("fold:parts").stats, "events_in") or 0)
            if done == {"big": want_big, "parts": 2 * want_big, "tiered": 6000} and folded == (
                2 * want_big
            ):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"stages did not finish: {done}, fold:parts {folded}")
        time.sleep(2)  # let the remaining folds commit
    finally:
        run.request_stop()
        thread.join(60)

    engine = QueryEngine(cfg, r)
    end = now + 60_000
    for card in CARDS:
        mine = [e for e in events if e["card"] == card]
        big = [e for e in mine if e["qty"] >= 5]
        assert engine.query("n", [card], "1h", end)["value"] == len(mine)
        assert engine.query("big_n", [card], "1h", end)["value"] == len(big)
        assert engine.query("big_qty", [card], "1h", end)["value"] == sum(e["qty"] for e in big)
        assert engine.query("parts_qty", [card], "1h", end)["value"] == 11 * sum(
            e["qty"] for e in big
        )
    for tier in ("gold", "basic"):
        want = sum(1 for e in events if TIERS[e["card"]] == tier)
        assert engine.query("tier_n", [tier], "1h", end)["value"] == want

    # the readers' books: in = dead + passed on; each of the three readers of `events` counted
    # the bad entry with its reason, and its record was written once, by the first of them
    bad = len(shards)
    for reader in ("big", "tiered", "spark"):
        books = {k.decode(): v.decode() for k, v in r.hgetall(stats_keys(reader).stats).items()}
        assert int(books["events_in"]) == 6000 + bad, reader
        assert int(books["dead_letters"]) == int(books["dead_bad_type"]) == bad, (reader, books)
    records = r.xrange(dead_letter_stream_key("events"))
    assert [f[b"reason"] for _, f in records] == [b"bad_type"] * bad
    # every stream is trimmed to what its slowest reader committed: nothing is left unread
    for spec in graph.streams.values():
        for key in spec.shards:
            assert r.xlen(key) <= 1, key
    offsets = r.hgetall(shard_side_key("rd", shard))
    assert {k.decode() for k in offsets} == {"", "big", "tiered"}


def test_a_rerun_batch_writes_its_output_once(
    redis_url: str, r: redis.Redis, spark: Any, tmp_path: Path
) -> None:
    """Spark re-runs a batch after a crash with the same id and input: nothing is written
    twice, and a half-written batch is completed."""
    from sluice.graph import StreamsSpec
    from sluice.source.decode import spark_schema_ddl
    from sluice.source.options import SourceOptions

    cfg = config_from_dict(stage_config(redis_url, tmp_path))
    _, parts = build_queries(cfg, RedisHandle(redis_url), spark)
    stage = next(p for p in parts if isinstance(p, StageQuery) and p.name == "parts")
    opts = SourceOptions(
        url=redis_url, log=StreamsSpec(("big",)), format="jsonl",
        fields=(("ts", "long", True), ("card", "string", False), ("merchant", "string", False),
                ("amount", "double", False), ("qty", "long", False)),
        time_field="ts", max_events_per_batch=None, max_string_bytes=4096,
    )  # fmt: skip
    rows = [
        (1000 + i, f"c{i % 5}", "m", 1.0, i, 1000 + i, 0, 0, None, None, None, 0, None, i)
        for i in range(3000)
    ]
    batch = spark.createDataFrame(rows, spark_schema_ddl(opts))
    first = stage.process_batch(batch, 5)
    lengths = {s: r.xlen(s) for s in ("parts:0", "parts:1")}
    assert first["out"] == 6000 and sum(lengths.values()) == first["entries"] > 0
    again = stage.process_batch(batch, 5)
    assert {s: r.xlen(s) for s in ("parts:0", "parts:1")} == lengths
    assert again["entries"] == 0 and again["replayed_chunks"] > 0
    # a partial first attempt: drop one chunk's marker and its entries' effect is re-done once
    marker = next(iter(r.scan_iter("sluice:emit:*")))
    r.delete(marker)
    third = stage.process_batch(batch, 5)
    assert third["entries"] > 0 and third["replayed_chunks"] == again["replayed_chunks"] - 1


def test_stage_config_errors_name_the_field(redis_url: str, spark: Any, tmp_path: Path) -> None:
    data = stage_config(redis_url, tmp_path)
    data["stages"][0]["sql"] = "SELECT nope FROM input"
    with pytest.raises(ConfigError, match=r"stages\[0\]\.sql"):
        build_queries(config_from_dict(data), RedisHandle(redis_url), spark)
    data = stage_config(redis_url, tmp_path)
    data["stages"][1]["sql"] = "SELECT ts, card, array(qty) AS qty FROM input"
    with pytest.raises(ConfigError, match=r"type array<bigint>"):
        build_queries(config_from_dict(data), RedisHandle(redis_url), spark)
    data = stage_config(redis_url, tmp_path)
    data["metrics"][4]["key"] = ["merchant"]  # `tiered` has ts, card, tier
    with pytest.raises(ConfigError, match=r"metrics\[4\]\.key.*not in stream 'tiered'"):
        build_queries(config_from_dict(data), RedisHandle(redis_url), spark)


def test_hop_by_hop_topology_and_heron_style(tmp_path: Path) -> None:
    data = stage_config("redis://127.0.0.1:1/0", tmp_path)
    flow = graph_topology(config_from_dict(data)).flow
    assert flow["big"].upstreams == ("ingest",)
    assert flow["parts"].upstreams == ("big",)
    assert flow["fold:parts"].upstreams == ("parts",)
    assert flow["store:parts"].upstreams == ("fold:parts",)
    assert flow["spark"].upstreams == ("ingest",)
    data["backpressure"] = {"propagation": "source"}
    heron = graph_topology(config_from_dict(data)).flow
    assert {s.upstreams for n, s in heron.items() if n != "ingest"} == {("ingest",)}


def test_a_run_can_take_some_queries_only(redis_url: str, spark: Any, tmp_path: Path) -> None:
    """Stages may run in separate Spark applications: each runs the queries it is given."""
    cfg = config_from_dict(stage_config(redis_url, tmp_path))
    _, parts = build_queries(cfg, RedisHandle(redis_url), spark, only=("big", "fold:big"))
    assert [p.name for p in parts] == ["big", "fold:big"]
    with pytest.raises(ConfigError, match="no query named nope; this config has big, "):
        build_queries(cfg, RedisHandle(redis_url), spark, only=("nope",))
