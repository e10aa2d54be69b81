"""A backfill's new slice hashes created with RESTORE (`pipeline.slice_restore`), on a real Redis
and a real Redis Cluster: the store it leaves is the one the slice script leaves, byte for byte,
and a Redis that refuses the command gets the same store through the script."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import redis

from sluice.pipeline import slice_restore
from sluice.pipeline.slice_restore import mostly_stored, plan_restores
from sluice.pipeline.slice_writes import build_calls, send_calls
from sluice.redis.dump import ZIPLIST_LIMITS, ziplist_limits
from sluice.redis.keys import slice_hash_key
from sluice.slices.aggs import AGGS

SLICE_MS, RETENTION_MS = 10_000, 600_000


@pytest.fixture
def seam() -> int:
    """A seam a little before now, taken when the test runs: the hashes it writes expire a
    retention (10 minutes) after their newest slice."""
    return time.time_ns() // 1_000_000 // SLICE_MS * SLICE_MS - 5 * SLICE_MS


def _rows(agg: str, metric: str, rng: np.random.Generator,
          seam: int) -> list[tuple[str, int, list[Any]]]:  # fmt: skip
    """Slices of 60 keys: 1 to 6 slices each, some of them past retention of the key's newest,
    one key with 40 slices (more than the script run the test allows a RESTORE)."""
    width = AGGS[agg].width
    out = []
    for i in range(60):
        n = 40 if i == 7 else int(rng.integers(1, 7))
        # Each key's newest slice is the one before the seam (so that it outlives the test).
        starts = seam - SLICE_MS * (1 + np.append(0, 1 + rng.choice(119, n - 1, replace=False)))
        for s in starts:
            numbers = (
                [int(x) for x in rng.integers(1, 9, width)]
                if agg == "count"
                else [round(float(x), 3) for x in rng.uniform(-5, 5, width)]
            )
            out.append((slice_hash_key(metric, f"k{i}"), int(s), numbers))
    return out


def _columns(rows: list[tuple[str, int, list[Any]]], agg: str) -> tuple[Any, ...]:
    a = AGGS[agg]
    keys = pa.array([k for k, _, _ in rows], pa.string())
    starts = np.array([s for _, s, _ in rows], dtype=np.int64)
    states = [pc.cast(pa.array([v[j] for _, _, v in rows]), pa.string()) for j in range(a.width)]
    return (a.state, SLICE_MS, RETENTION_MS, a.width), keys, starts, states


def _scripted(client: Any, rows: list[tuple[str, int, list[Any]]], agg: str,
              cluster: bool, seam: int) -> list[int]:  # fmt: skip
    head, keys, starts, states = _columns(rows, agg)
    totals, failed = send_calls(client, build_calls(f"b{seam}", head, keys, starts, states,
                                                    cluster))  # fmt: skip
    assert not failed.any()
    return totals


def _restored(client: Any, rows: list[tuple[str, int, list[Any]]], agg: str,
              cluster: bool, seam: int) -> list[int]:  # fmt: skip
    head, keys, starts, states = _columns(rows, agg)
    totals, failed = plan_restores(f"b{seam}", head, keys, starts, states, cluster).run(client)
    assert not failed.any()
    return totals


def _stored(client: Any, metric: str) -> dict[str, tuple[dict[bytes, bytes], int]]:
    out = {}
    for i in range(60):
        key = slice_hash_key(metric, f"k{i}")
        out[f"k{i}"] = (client.hgetall(key), client.pttl(key))
    return out


def _restore_calls(client: Any, cluster: bool = False) -> int:
    """RESTOREs Redis ran (on a cluster, summed over its masters)."""
    if not cluster:
        return int(client.info("commandstats").get("cmdstat_restore", {}).get("calls", 0))
    per_node = client.info("commandstats", target_nodes=client.PRIMARIES)
    return sum(int(s.get("cmdstat_restore", {}).get("calls", 0)) for s in per_node.values())


def _restores_refused(client: Any) -> int:
    """RESTOREs Redis refused before running them (here: by ACL)."""
    stats = client.info("commandstats").get("cmdstat_restore", {})
    return int(stats.get("rejected_calls", 0))


@pytest.mark.parametrize("agg", ["count", "avg", "max"])
@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("payloads", ["c", "arrow"])
def test_restored_hashes_are_the_scripts_byte_for_byte(
    r: redis.Redis, rc: Any, agg: str, cluster: bool, payloads: str, monkeypatch: Any, seam: int
) -> None:
    """The same archive through the script alone and through RESTORE: the same slices, `_m`,
    `_b`, expiry (within the test's own time) and counts. Keys that exist already (a live fold's
    and an earlier run's) are refused by RESTORE and merged by the script, as are keys with more
    slices than one script run; the rest are created by one RESTORE each. Payloads built in C
    (ziplists) and by the Arrow code (the plain type) alike."""
    if payloads == "arrow":
        monkeypatch.setattr(slice_restore, "_items_in_c", None)
    monkeypatch.setattr(slice_restore, "SLICES_PER_RUN", 30)
    monkeypatch.setattr(slice_restore, "COMMANDS_PER_ROUND_TRIP", 7)  # rounds sent ahead
    client = rc if cluster else r
    rng = np.random.default_rng(7)
    rows = _rows(agg, "via-script", rng, seam)
    twin = [(k.replace("via-script", "via-restore"), s, v) for k, s, v in rows]
    # A live fold wrote every sixth key first, at the seam and before it (replaced by the
    # archive): fewer than half of them, so the RESTOREs go on past them.
    a = AGGS[agg]
    live = [(slice_hash_key(m, f"k{i}"), s, [1] * a.width)
            for m in ("via-script", "via-restore") for i in range(0, 60, 6)
            for s in (seam, seam - SLICE_MS)]  # fmt: skip
    head, keys, starts, states = _columns(live, agg)
    assert send_calls(client, build_calls(3, head, keys, starts, states, cluster))[0][0] == 40
    calls_before = _restore_calls(client, cluster)
    want = _scripted(client, rows, agg, cluster, seam)
    twin_keys = _columns(twin, agg)[1]
    assert not mostly_stored(client, twin_keys)  # a sixth of them: RESTOREs are built
    got = _restored(client, twin, agg, cluster, seam)
    assert got == want and want[0] + want[2] == len(rows) and want[2] > 0
    assert _restore_calls(client, cluster) - calls_before == 59  # every key but the long one tried
    scripted, restored = _stored(client, "via-script"), _stored(client, "via-restore")
    assert scripted.keys() == restored.keys()
    for k, (fields, ttl) in scripted.items():
        assert restored[k][0] == fields, k
        assert fields[b"_b"] == str(seam).encode()
        assert ttl > 0 and abs(restored[k][1] - ttl) < 5_000
    assert scripted["k0"][0][str(seam).encode()] == f"3:{':'.join(['1'] * a.width)}".encode()
    # A second run (a task run again) meets every hash: the script replaces with the same texts.
    # Half of the first round existed, so the RESTOREs stop there (on one Redis, the round sent
    # ahead of those replies is read too).
    assert mostly_stored(client, twin_keys)  # a writer asks first and sends none (writer.py)
    calls_before = _restore_calls(client, cluster)
    assert _restored(client, twin, agg, cluster, seam) == want
    assert _restore_calls(client, cluster) - calls_before == (7 if cluster else 14)
    again = _stored(client, "via-restore")
    assert all(again[k][0] == restored[k][0] for k in restored)


def test_a_redis_that_refuses_restore_gets_the_same_store_through_the_script(
    r: redis.Redis, redis_server: Any, seam: int, monkeypatch: Any
) -> None:
    """An ACL user without RESTORE (as a managed Redis may have): the first refusal stops the
    RESTOREs (the round already sent is read), every write goes through the script, and the
    store is the script's."""
    monkeypatch.setattr(slice_restore, "COMMANDS_PER_ROUND_TRIP", 7)
    r.acl_setuser("no-restore", enabled=True, nopass=True, keys=["*"],
                  commands=["+@all", "-restore"])  # fmt: skip
    limited = redis.Redis.from_url(redis_server.url, username="no-restore")
    try:
        rows = _rows("sum", "via-script", np.random.default_rng(3), seam)
        twin = [(k.replace("via-script", "via-restore"), s, v) for k, s, v in rows]
        want = _scripted(r, rows, "sum", False, seam)
        before = _restore_calls(r), _restores_refused(r)
        assert _restored(limited, twin, "sum", False, seam) == want
        # Refused in the first round; the second was on its way; nothing more was sent.
        assert (_restore_calls(r), _restores_refused(r)) == (before[0], before[1] + 14)
        scripted, restored = _stored(r, "via-script"), _stored(r, "via-restore")
        assert all(restored[k][0] == scripted[k][0] for k in scripted)
    finally:
        limited.close()
        r.acl_deluser("no-restore")


# Texts at each edge of how a ziplist stores them: the integers of each width (0..12 in the
# encoding byte itself, then 8, 16, 24, 32 and 64 bits), and texts that only look like integers.
EDGE_TEXTS = [
    "0", "12", "13", "-1", "127", "128", "-128", "-129", "32767", "32768", "-32769", "8388607",
    "8388608", "-8388609", "2147483647", "2147483648", "-2147483649", "9223372036854775807",
    "-9223372036854775808", "9223372036854775808", "007", "-0", "+5", "1e3", " 5", "", "x" * 64,
    "0:3", "0:1.5:-2", "0:" + "9" * 29, "1" * 31, "1" * 32,
]  # fmt: skip


def test_a_ziplist_payload_is_the_one_redis_dumps(r: redis.Redis, monkeypatch: Any) -> None:
    """Hashes restored from the plain type (the Arrow path), which Redis builds into ziplists
    one push at a time, then DUMPed by Redis (compression off): the C payload, byte for byte.
    Restored from the C payload, each is the same hash, encoded the same."""
    rng = np.random.default_rng(4)
    counts = rng.integers(1, 9, 40)
    bounds = np.append(0, np.cumsum(counts))
    starts = np.concatenate([1_700_000_000_000 + 10_000 * np.sort(rng.choice(99, c, False))
                             for c in counts])  # fmt: skip
    texts = pa.array([EDGE_TEXTS[i % len(EDGE_TEXTS)] for i in range(int(bounds[-1]))])
    names = pa.array([f"sluice:s:{{m|{i}}}" for i in range(len(counts))])
    expiry = np.zeros(len(counts), np.int64)
    args = (names, expiry, bounds, starts, texts, "1699999990000")
    compact = slice_restore.restore_items(*args, resp=False).to_pylist()
    monkeypatch.setattr(slice_restore, "_items_in_c", None)
    plain = slice_restore.restore_items(*args, resp=False).to_pylist()
    assert all(p[:1] == b"\x04" for p in plain) and all(c[:1] == b"\x0d" for c in compact)
    r.config_set("rdbcompression", "no")
    try:
        for i, (name, p, c) in enumerate(zip(names.to_pylist(), plain, compact, strict=True)):
            r.restore(name, 0, p)
            assert r.object("encoding", name) == b"ziplist"
            assert r.dump(name) == c, i
            r.restore(f"{name}:c", 0, c)
            assert r.hgetall(f"{name}:c") == r.hgetall(name)
            assert r.object("encoding", f"{name}:c") == b"ziplist"
    finally:
        r.config_set("rdbcompression", "yes")


def test_hashes_past_the_servers_ziplist_limits_take_the_plain_type(r: redis.Redis) -> None:
    """`ziplist_limits` reads the server's; a hash with more pairs or a longer value than they
    allow is sent as the plain type, and Redis makes it the hash table it would have made."""
    saved = r.config_get("hash-max-ziplist-*")
    assert ziplist_limits(r) == (int(saved["hash-max-ziplist-entries"]),
                                 int(saved["hash-max-ziplist-value"]))  # fmt: skip
    assert ZIPLIST_LIMITS == (128, 64)  # Redis's defaults, where CONFIG is refused
    r.config_set("hash-max-ziplist-value", 30)
    r.config_set("hash-max-ziplist-entries", 100)
    try:
        limits = ziplist_limits(r)
        assert limits == (100, 30)
        names = pa.array(["sluice:s:{m|short}", "sluice:s:{m|long}", "sluice:s:{m|many}"])
        starts = 1_700_000_000_000 + 10_000 * np.arange(1 + 1 + 99)
        texts = pa.array(["0:1", "0:" + "5" * 29] + ["0:2"] * 99)  # 99 slices: 101 pairs
        bounds = np.array([0, 1, 2, 101])
        items = slice_restore.restore_items(names, np.zeros(3, np.int64), bounds, starts, texts,
                                            "1699999990000", limits, resp=False)  # fmt: skip
        assert [p[:1] for p in items.to_pylist()] == [b"\x0d", b"\x04", b"\x04"]
        for name, p in zip(names.to_pylist(), items.to_pylist(), strict=True):
            r.restore(name, 0, p)
        assert [r.object("encoding", n) for n in names.to_pylist()] == [
            b"ziplist",
            b"hashtable",
            b"hashtable",
        ]
        assert r.hlen("sluice:s:{m|many}") == 101 and r.hget("sluice:s:{m|long}", "_b")
    finally:
        r.config_set("hash-max-ziplist-value", saved["hash-max-ziplist-value"])
        r.config_set("hash-max-ziplist-entries", saved["hash-max-ziplist-entries"])
