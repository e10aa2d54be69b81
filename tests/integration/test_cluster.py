"""Sluice on a real 3-master Redis Cluster: the whole pipeline (real Spark) writes slices, stats,
dead letters and the audit ledger across slots; every count and sum matches the reference
computed from the produced events; the keys spread over the masters; the API answers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pandas as pd
import pytest
import redis

from sluice.config import Config
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.slice_writes import run_write_script
from sluice.query.engine import Lookup, QueryEngine
from sluice.redis.cluster import node_clients
from sluice.redis.connection import RedisHandle, client_for
from sluice.redis.keys import STATS_KEY, key_slot, shard_keys, shard_side_key, slice_hash_key
from sluice.redis.local_cluster import LocalCluster
from sluice.server.app import create_app
from sluice.source.loadgen import produce_frame
from sluice.source.producer import Producer
from sluice.status.ledger import Ledger
from tests.conftest import ServerThread, make_config

pytestmark = [pytest.mark.spark]

N_EVENTS = 60_000
N_BAD = 20
SEED = 11
SPAN_MS = 30 * 60_000


def make_events(now_ms: int) -> pd.DataFrame:
    """Seeded events over the last 30 minutes (5% up to 10 minutes late), Zipf keys."""
    rng = np.random.default_rng(SEED)
    arrival = np.sort(rng.integers(now_ms - SPAN_MS, now_ms - 1000, N_EVENTS))
    late = rng.random(N_EVENTS) < 0.05
    ts = np.where(late, arrival - rng.integers(0, 10 * 60_000, N_EVENTS), arrival)
    amount = np.round(rng.lognormal(3.0, 1.2, N_EVENTS), 2)
    amount[rng.random(N_EVENTS) < 0.03] *= -1
    return pd.DataFrame(
        {
            "ts": ts.astype(np.int64),
            "card": [f"card-{i}" for i in (rng.zipf(1.2, N_EVENTS) - 1) % 3000],
            "merchant": [f"m-{i}" for i in (rng.zipf(1.4, N_EVENTS) - 1) % 300],
            "amount": amount,
            "qty": rng.integers(0, 100, N_EVENTS),
        }
    )


@dataclass
class Run:
    cfg: Config
    url: str
    events: pd.DataFrame
    now_ms: int
    cluster: LocalCluster


@pytest.fixture(scope="module")
def run(
    spark: Any, redis_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    """The real pipeline over 3 input shards, once for the module, until its input is drained."""
    redis_cluster.flushall()
    url = redis_cluster.url
    state = tmp_path_factory.mktemp("state")
    cfg = make_config(url, state, source={"shards": 3, "max_events_per_batch": 15_000})
    client = client_for(url)
    now = time.time_ns() // 1_000_000
    events = make_events(now)
    producer = Producer.from_config(cfg, client, batch_events=500)
    for start in range(0, N_EVENTS, 10_000):
        produce_frame(producer, events.iloc[start : start + 10_000], producer.shard_by)
    bad = b'{"ts": %d, "card": "card-1", "merchant": "m-1", "amount": "x", "qty": 1}' % now
    for _ in range(N_BAD // 2):  # 2 bad events per entry: a bad type and not JSON
        client.xadd(cfg.source.shard_keys()[1], {"d": bad + b"\nnot json", "n": 2})
    pipeline = FoldQuery(cfg, RedisHandle(url), spark)
    pipeline.start()
    try:
        assert pipeline.wait_idle(300), "the pipeline did not drain its input"
    finally:
        pipeline.stop()
    yield Run(cfg, url, events, now, redis_cluster)
    client.close()


def _ask(engine: QueryEngine, metric: str, keys: list[list[str]], end: int) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(keys), 1000):
        lookups = [Lookup(metric, tuple(k), 3_600_000, end) for k in keys[i : i + 1000]]
        out += [a["value"] for a in engine.run(lookups)]
    return out


def test_every_count_and_sum_matches_the_reference(run: Run) -> None:
    ev = run.events
    client = client_for(run.url)
    engine = QueryEngine(run.cfg, client)
    end = run.now_ms + 60_000  # the last hour: every event, whole slices
    cards = sorted(ev["card"].unique())
    merchants = sorted(ev["merchant"].unique())
    by_card = ev.groupby("card")
    by_merchant = ev.groupby("merchant")
    positive = ev[ev["amount"] > 0].groupby("merchant")["amount"].sum()

    assert _ask(engine, "txn_count", [[c] for c in cards], end) == [
        int(by_card.size()[c]) for c in cards
    ]
    assert _ask(engine, "txn_res", [[c] for c in cards], end) == [
        int(by_card.size()[c]) for c in cards
    ]
    assert _ask(engine, "card_max", [[c] for c in cards], end) == [
        int(by_card["qty"].max()[c]) for c in cards
    ]
    assert _ask(engine, "merchant_txn", [[m] for m in merchants], end) == [
        int(by_merchant.size()[m]) for m in merchants
    ]
    assert _ask(engine, "qty_sum", [[m] for m in merchants], end) == [
        int(by_merchant["qty"].sum()[m]) for m in merchants
    ]
    got = _ask(engine, "amount_sum", [[m] for m in merchants], end)
    want = [float(positive.get(m, 0.0)) for m in merchants]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
    pairs = ev.groupby(["card", "merchant"]).size()
    some = list(pairs.index[:: max(1, len(pairs) // 500)])
    assert _ask(engine, "pair_count", [list(p) for p in some], end) == [int(pairs[p]) for p in some]
    distinct = by_card["merchant"].nunique()
    for c, n in zip(cards, _ask(engine, "card_merchants", [[c] for c in cards], end), strict=True):
        assert abs(n - int(distinct[c])) <= 1 + 0.03 * int(distinct[c]), (c, n)
    assert _ask(engine, "txn_count", [["absent-key"]], end) == [0]
    client.close()


def test_counters_dead_letters_and_the_audit_ledger_balance(run: Run) -> None:
    client = client_for(run.url)
    st = {k.decode(): v.decode() for k, v in client.hgetall(STATS_KEY).items()}
    batches = int(st["batches"])
    assert int(st["events_in"]) == int(st["events_admitted"]) == N_EVENTS + N_BAD
    assert int(st["events_aggregated"]) == N_EVENTS
    assert int(st["dead_letters"]) == N_BAD
    assert int(st["audit_ok"]) == batches and "audit_failed" not in st
    assert int(st["updates_duplicate"]) == 0
    records = Ledger(client, "events", run.cfg.audit.ledger_shards).recent(batches - 1, batches)
    assert len(records) == batches and all(r["ok"] for r in records)
    assert sum(r["events"] for r in records) == N_EVENTS + N_BAD
    reasons = sorted(
        f[b"reason"].decode() for _, f in client.xrange(run.cfg.source.dead_letter_stream)
    )
    assert reasons == ["bad_json"] * (N_BAD // 2) + ["bad_type"] * (N_BAD // 2)
    # Every input shard was trimmed up to its committed id, and that id was published.
    for shard in run.cfg.source.shard_keys():
        committed = client.hget(shard_side_key("rd", shard), "")
        assert committed is not None, shard
        assert client.xlen(shard) <= 1, shard  # the committed entry itself stays
    client.close()


def test_slices_input_shards_and_ledger_spread_over_the_three_masters(run: Run) -> None:
    client = client_for(run.url)
    shards = run.cfg.source.shard_keys()
    assert shards == shard_keys("events", 3, hash_tags=True)
    assert {run.cluster.node_of_slot(key_slot(s)) for s in shards} == {0, 1, 2}
    # Without the tags, two of the three shards would share a master.
    plain = shard_keys("events", 3)
    assert len({run.cluster.node_of_slot(key_slot(s)) for s in plain}) == 2
    slices_per_node = []
    ledger_nodes = set()
    for i, node in enumerate(node_clients(client)):
        port = node.connection_pool.connection_kwargs["port"]
        n = run.cluster.ports.index(port)
        slices_per_node.append(sum(1 for _ in node.scan_iter(match="sluice:s:*", count=1000)))
        ledger_nodes |= {n for _ in node.scan_iter(match="sluice:audit:*", count=1000)}
        for s in shards:
            if run.cluster.node_of_slot(key_slot(s)) == n:
                assert node.exists(s), (i, s)  # the stream lives where its slot says
    assert all(n > 100 for n in slices_per_node), slices_per_node
    # The ledger's 16 hashes cover all three masters; those written so far are where they hash.
    ledger = Ledger(client, "events", run.cfg.audit.ledger_shards)
    assert {run.cluster.node_of_slot(key_slot(ledger.key(b))) for b in range(16)} == {0, 1, 2}
    batches = int(client.hget(STATS_KEY, "batches"))
    assert batches >= 4
    assert ledger_nodes == {
        run.cluster.node_of_slot(key_slot(ledger.key(b))) for b in range(batches)
    }
    client.close()


def test_the_http_api_answers_from_the_cluster(run: Run) -> None:
    ev = run.events
    client = client_for(run.url)
    card = str(ev["card"].value_counts().index[0])
    merchant = str(ev["merchant"].value_counts().index[3])
    end = run.now_ms + 60_000
    with (
        ServerThread(create_app(run.cfg, client, history=False)) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        one = http.get(
            "/v1/metrics/txn_count", params={"key": card, "window": "1h", "end": end}
        ).json()
        assert one["value"] == int((ev["card"] == card).sum())
        batch = http.post(
            "/v1/query",
            json={"queries": [
                {"metric": "merchant_txn", "key": [merchant], "window": "1h", "end": end},
                {"metric": "card_merchants", "key": [card], "window": "1h", "end": end},
                {"metric": "amount_q", "key": [merchant], "window": "1h", "end": end},
            ]},
        )  # fmt: skip
        assert batch.status_code == 200, batch.text
        res = batch.json()["results"]
        assert res[0]["value"] == int((ev["merchant"] == merchant).sum())
        assert res[1]["value"] > 0 and res[2]["value"]["0.5"] is not None
        status = http.get("/v1/status")
        assert status.status_code == 200, status.text
        assert status.json()["counters"]["events_in"] == N_EVENTS + N_BAD
        assert http.get("/healthz").status_code in (200, 503)
        assert "sluice_redis_up 1" in http.get("/metrics").text
    client.close()


def test_a_script_call_keeps_its_keys_in_one_slot(rc: Any, tmp_path: Path) -> None:
    """write_slices.lua takes many keys per call; on a cluster they are grouped by slot."""
    keys = [slice_hash_key("n", f"k{i}") for i in range(40)]
    assert len({key_slot(k) for k in keys}) > 1
    s = str(time.time_ns() // 1_000_000 // 1000 * 1000)  # a slice of now (older ones expire)
    calls = [(k, ["count", "1000", "86400000", "1", "1", s, "1"], ("l", 0, k)) for k in keys]
    failed: set[Any] = set()
    assert run_write_script(rc, 1, calls, failed, cluster=True) == [40, 0, 0, 0] and not failed
    assert run_write_script(rc, 1, calls, failed, cluster=True) == [0, 40, 0, 0]  # duplicates
    from redis.exceptions import RedisClusterException

    with pytest.raises(RedisClusterException, match=r"same (key )?slot"):
        run_write_script(rc, 2, calls, failed)


def test_the_stats_scripts_and_the_board_run_on_the_cluster(rc: Any) -> None:
    from sluice.flow.board import Board
    from sluice.redis.keys import HISTORY_KEY
    from sluice.status.history import record_sample

    rc.script_flush()  # record_sample must load its script on the master it lands on
    now_s = time.time_ns() // 1_000_000_000
    assert record_sample(rc, {"t": (now_s - 1) * 1000, "events_in": 1})
    assert record_sample(rc, {"t": now_s * 1000, "events_in": 5})
    assert not record_sample(rc, {"t": now_s * 1000, "events_in": 6})  # one per second
    assert [orjson.loads(s)["events_in"] for s in rc.lrange(HISTORY_KEY, 0, -1)] == [5, 1]
    board = Board(rc)
    board.publish("spark/h/1", {"stage": "spark", "updated_ms": now_s * 1000}, changed=True)
    board.send("producer/h/2", "overload", "spark/h/1", 10, now_s * 1000)
    got, _ = board.receive("producer/h/2", "0-0")
    assert [s.kind for s in got] == ["overload"]
    assert list(board.tasks(now_s * 1000)) == ["spark/h/1"]


def test_strict_durability_is_checked_and_set_on_every_master(tmp_path: Path) -> None:
    from sluice.redis.connection import open_redis

    with (
        LocalCluster(tmp_path / "c", masters=3) as cluster,
        open_redis(cluster.url, tmp_path, durability="strict") as handle,
    ):
        assert handle.persistence["appendfsync"] == "always"
        for node in node_clients(handle.client):
            assert node.config_get("appendfsync") == {"appendfsync": "always"}
            assert node.config_get("appendonly") == {"appendonly": "yes"}


def test_a_cluster_address_that_does_not_work_fails_with_the_reason(redis_url: str) -> None:
    from sluice.errors import RedisUnavailable
    from sluice.redis.connection import check_reachable

    with pytest.raises(RedisUnavailable, match=r"redis\+cluster://:\*\*\*@127.0.0.1:1 .*refused"):
        check_reachable("redis+cluster://:pw@127.0.0.1:1")
    single = redis_url.removeprefix("redis://").removesuffix("/0")
    with pytest.raises(RedisUnavailable, match=r"[Cc]luster mode is not enabled"):
        check_reachable(f"redis+cluster://{single}")


def test_an_added_master_can_give_its_slots_away_and_take_them_back(tmp_path: Path) -> None:
    """Migrations that go round every master empty the added one now and then; it must stay a
    master (Redis 6.2 would make it a replica), or the next move to it fails."""
    with LocalCluster(tmp_path / "c", masters=1) as cluster:
        client = client_for(cluster.url)
        keys = [slice_hash_key("txn_count", f"c{i}") for i in range(3)]
        for key in keys:
            client.hset(key, "f", key)
        slots = sorted({key_slot(key) for key in keys})
        added = cluster.add_master()
        for to in (added, 0, added, 0):
            for slot in slots:
                cluster.migrate_slot(slot, to)
            # after the moves to 0 the added master holds no slot at all
            assert all(client.hget(key, "f") == key.encode() for key in keys)
        with cluster._client(added) as node:
            assert node.execute_command("ROLE")[0] in (b"master", "master")


def test_an_ask_to_a_master_the_client_has_not_met_is_followed(tmp_path: Path) -> None:
    """A master joins after the client read the slot map, and a slot starts migrating onto it:
    a command on a key that has already left (or never was) gets ASK to the new master, which
    the client follows (redis-py alone fails there with AttributeError)."""
    with LocalCluster(tmp_path / "cluster", masters=3) as cluster:
        client = client_for(cluster.url)
        key = "sluice:ask-probe"
        slot = key_slot(key)
        src = cluster.node_of_slot(slot)
        assert client.set("sluice:other", b"1")  # the client has read the slot map
        new = cluster.add_master()
        ids = []
        for port in (cluster.ports[src], cluster.ports[new]):
            with redis.Redis(port=port) as node:
                ids.append(node.execute_command("CLUSTER MYID").decode())
        with redis.Redis(port=cluster.ports[new]) as b, redis.Redis(port=cluster.ports[src]) as a:
            b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[0])
            a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[1])
        assert client.set(key, b"on the new master")  # not on the source: ASK to the new one
        with redis.Redis(port=cluster.ports[new]) as b:
            assert b.execute_command("ASKING") and b.get(key) == b"on the new master"
        client.close()
