"""Faults of a real 3-master Redis Cluster while the pipeline runs under steady load:

- a master is shut down and started again. Its slots are unavailable meanwhile (no replicas), so
  batches fail and the supervisor restarts the query;
- a fourth master joins, and slots are migrated to it and round all four masters with their keys
  (the stats, an input shard, busy slice hashes), as adding a machine and resharding do, while
  clients keep using them.

At the end every count and sum equals the reference computed from what the cluster
acknowledged, and every committed batch balanced its audit."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from sluice.pipeline.fold import FoldQuery
from sluice.query.engine import Lookup, QueryEngine
from sluice.redis.connection import RedisHandle, client_for
from sluice.redis.keys import HEALTH_KEY, STATS_KEY, key_slot, slice_hash_key
from sluice.redis.local_cluster import LocalCluster
from sluice.status.ledger import Ledger
from tests.conftest import make_config

pytestmark = [pytest.mark.spark, pytest.mark.slow]

METRICS = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1d"},
    {"name": "qty_sum", "key": ["merchant"], "agg": "sum", "value": "qty", "slice": "1m",
     "retention": "1d"},
]  # fmt: skip


class ClusterProducer(threading.Thread):
    """About 1,000 events/s in entries of 50 over the shards, each XADD with an explicit id.

    While a master is down its shard's XADD fails and is retried with the same id; a retry
    refused because the id is already there means the first attempt landed. Only acknowledged
    entries go into the reference, so it is exact either way."""

    def __init__(self, client: Any, shards: list[str]) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.shards = shards
        self.stop = threading.Event()
        self.cards: Counter[str] = Counter()
        self.qty: Counter[str] = Counter()
        self.events = 0
        self.retries = 0

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            now = time.time_ns() // 1_000_000
            batch = [
                {"ts": now, "card": f"c{(seq + j) % 60}", "merchant": f"m{(seq + j) % 7}",
                 "amount": 1.5, "qty": (seq + j) % 5}
                for j in range(50)
            ]  # fmt: skip
            shard = self.shards[(seq // 50) % len(self.shards)]
            payload = b"\n".join(orjson.dumps(e) for e in batch)
            self._add(shard, f"{now}-{seq}", {"d": payload, "n": 50})
            for e in batch:
                self.cards[e["card"]] += 1
                self.qty[e["merchant"]] += e["qty"]
            self.events += len(batch)
            seq += 50
            time.sleep(0.05)

    def _add(self, shard: str, entry_id: str, fields: dict[str, Any]) -> None:
        while True:
            try:
                self.client.xadd(shard, fields, id=entry_id)
                return
            except redis.ResponseError as e:
                if "equal or smaller" in str(e):
                    return  # an earlier attempt landed
                self.retries += 1
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError):
                self.retries += 1
            time.sleep(0.2)


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def _check_final_state(cfg: Any, client: Any, producer: ClusterProducer) -> dict[str, str]:
    """Counts and sums equal the reference; every committed batch balanced. Returns the stats."""
    stats = {k.decode(): v.decode() for k, v in client.hgetall(STATS_KEY).items()}
    assert int(stats["events_in"]) == int(stats["events_admitted"]) == producer.events
    engine = QueryEngine(cfg, client)
    end = time.time_ns() // 1_000_000 + 60_000
    cards = sorted(producer.cards)
    merchants = sorted(producer.qty)
    got = engine.run([Lookup("txn_count", (c,), 3_600_000, end) for c in cards])
    assert {c: a["value"] for c, a in zip(cards, got, strict=True)} == dict(producer.cards)
    got = engine.run([Lookup("qty_sum", (m,), 3_600_000, end) for m in merchants])
    assert {m: a["value"] for m, a in zip(merchants, got, strict=True)} == dict(producer.qty)
    batches = int(stats["batches"])
    ledger = Ledger(client, "events", cfg.audit.ledger_shards)
    assert int(stats["audit_ok"]) == batches
    assert "audit_failed" not in stats, [(f, ledger.get(f["batch"])) for f in ledger.failures()]
    last = int(orjson.loads(stats["last_batch"])["batch"])
    records = ledger.recent(last, last + 1)
    assert records and all(rec["ok"] for rec in records)
    return stats


def test_a_master_added_and_slots_migrated_under_load_lose_nothing_and_count_nothing_twice(
    spark: Any, tmp_path: Path
) -> None:
    with LocalCluster(tmp_path / "cluster", masters=3) as cluster:
        cfg = make_config(cluster.url, tmp_path / "state", metrics=METRICS, derived=[],
                          source={"shards": 3})  # fmt: skip
        client = client_for(cluster.url)
        shards = cfg.source.shard_keys()
        slots = sorted({
            key_slot(STATS_KEY),  # counters, batch list, freshness: record_batch.lua's keys
            key_slot(shards[0]),
            key_slot(slice_hash_key("txn_count", "c0")),
            key_slot(slice_hash_key("qty_sum", "m0")),
        })  # fmt: skip
        pipeline = FoldQuery(cfg, RedisHandle(cluster.url), spark)
        supervisor = threading.Thread(target=pipeline.run_forever, daemon=True)
        producer = ClusterProducer(client_for(cluster.url), shards)

        def stat(name: str) -> int:
            return int(client.hget(STATS_KEY, name) or 0)

        supervisor.start()
        producer.start()
        moved = migrations = 0
        try:
            _wait(lambda: stat("events_in") > 2000, 240, "batches before the migrations")
            # A master joins the running cluster and takes every slot first (a machine added
            # under load); then the slots keep moving round all four masters until several more
            # batches committed and every slot moved at least twice, so that migrations overlap
            # batch writes, audits and commits however quick the batches are.
            added = cluster.add_master()
            first = stat("batches")
            deadline = time.monotonic() + 180
            while (
                stat("batches") < first + 4 or migrations < 2 * len(slots)
            ) and time.monotonic() < deadline:
                slot = slots[migrations % len(slots)]
                to = added if migrations < len(slots) else cluster.node_of_slot(slot) + 1
                moved += cluster.migrate_slot(slot, to % cluster.masters)
                migrations += 1
                time.sleep(0.2)
            assert stat("batches") >= first + 4, "too few batches during the migrations"
            producer.stop.set()
            producer.join(30)
            _wait(lambda: stat("events_in") >= producer.events, 240, "the backlog to drain")
            time.sleep(2.0)  # anything counted twice would show up as more than produced
        finally:
            producer.stop.set()
            pipeline.request_stop()
            supervisor.join(60)
        assert migrations >= 2 * len(slots) and moved >= migrations  # keys moved with them
        _check_final_state(cfg, client, producer)
        client.close()


def test_a_master_restart_under_load_loses_nothing_and_counts_nothing_twice(
    spark: Any, tmp_path: Path
) -> None:
    with LocalCluster(tmp_path / "cluster", masters=3, appendonly=True) as cluster:
        cfg = make_config(cluster.url, tmp_path / "state", metrics=METRICS, derived=[],
                          source={"shards": 3})  # fmt: skip
        client = client_for(cluster.url)
        shards = cfg.source.shard_keys()
        # The master to restart holds a shard, the stats and a share of the slices.
        victim = cluster.node_of_slot(key_slot(STATS_KEY))
        assert victim in {cluster.node_of_slot(key_slot(s)) for s in shards}
        pipeline = FoldQuery(cfg, RedisHandle(cluster.url), spark)
        supervisor = threading.Thread(target=pipeline.run_forever, daemon=True)
        producer = ClusterProducer(client_for(cluster.url), shards)

        def events_in() -> int:
            try:
                return int(client.hget(STATS_KEY, "events_in") or 0)
            except (redis.RedisError, redis.exceptions.RedisClusterException):
                return -1

        supervisor.start()
        producer.start()
        try:
            _wait(lambda: events_in() > 2000, 240, "batches before the restart")
            cluster.restart_node(victim, down_s=4.0)  # longer than cluster-node-timeout
            after = events_in()
            _wait(lambda: events_in() > after + 2000, 240, "batches after the restart")
            producer.stop.set()
            producer.join(30)
            _wait(lambda: events_in() >= producer.events, 240, "the backlog to drain")
            time.sleep(2.0)  # anything counted twice would show up as more than produced
        finally:
            producer.stop.set()
            pipeline.request_stop()
            supervisor.join(60)
        assert producer.retries > 0, "the producer never saw the master down"
        _check_final_state(cfg, client, producer)
        # The query failed while the master was down and the supervisor restarted it.
        assert int(client.hget(HEALTH_KEY, "restarts") or 0) >= 1
        client.close()
