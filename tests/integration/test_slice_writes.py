"""write_slices.lua through the columnar writer (`pipeline.slice_writes`), on a real Redis and a
real Redis Cluster: merges, replays, retention, expiry, slices stored by the writer before this
layout, and a call whose reply does not add up."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import redis

from sluice.pipeline import slice_writes
from sluice.pipeline.slice_restore import plan_restores
from sluice.pipeline.slice_writes import (
    Calls,
    build_calls,
    expire_at_ms,
    run_write_script,
    send_calls,
)
from sluice.redis.keys import slice_hash_key
from sluice.redis.scripts import READ_SLICES, script_source
from sluice.slices.aggs import AGGS

SLICE_MS, RETENTION_MS = 10_000, 3_600_000
NOW = time.time_ns() // 1_000_000 // SLICE_MS * SLICE_MS


def _write(client: Any, token: int, agg: str, rows: list[tuple[str, int, list[Any]]],
           cluster: bool = False,
           ref_ms: int | None = None) -> tuple[list[int], np.ndarray]:  # fmt: skip
    """Slices (key, start, numbers) of `agg` through build_calls + send_calls, by a writer whose
    reference time is `ref_ms`."""
    a = AGGS[agg]
    keys = pa.array([k for k, _, _ in rows], pa.string())
    starts = np.array([s for _, s, _ in rows], dtype=np.int64)
    cols = [pa.array([v[j] for _, _, v in rows]) for j in range(a.width)]
    states = [pc.cast(c, pa.string()) for c in cols]
    calls = build_calls(token, (a.state, SLICE_MS, RETENTION_MS, a.width), keys, starts, states,
                        cluster, ref_ms)  # fmt: skip
    return send_calls(client, calls)


def _read(client: Any, key: str, agg: str, first: int, last: int) -> list[float]:
    script = client.register_script(script_source(READ_SLICES))
    got = script(keys=[key], args=[AGGS[agg].state, first, last, SLICE_MS])
    return [float(x) for x in got]


def test_merges_replays_and_many_calls(r: redis.Redis, monkeypatch: Any) -> None:
    monkeypatch.setattr(slice_writes, "KEYS_PER_CALL", 7)
    keys = [slice_hash_key("m", f"k{i}") for i in range(30)]
    rows = [
        (k, NOW - j * SLICE_MS, [i + j + 0.1]) for i, k in enumerate(keys) for j in range(i % 3 + 1)
    ]
    totals, failed = _write(r, 10, "sum", rows)
    assert totals == [len(rows), 0, 0, 0] and not failed.any()
    assert _write(r, 10, "sum", rows)[0] == [0, len(rows), 0, 0]  # a replay: all duplicates
    assert _write(r, 11, "sum", rows)[0] == [len(rows), 0, 0, 0]
    for i, k in enumerate(keys):
        n = i % 3 + 1
        want = sum(2 * (i + j + 0.1) for j in range(n))
        got = _read(r, k, "sum", NOW - 5 * SLICE_MS, NOW)
        assert got[0] == n and got[1] == pytest.approx(want, rel=1e-12)
        assert r.hget(k, "_m") == f"{NOW}:{NOW - (n - 1) * SLICE_MS}".encode()
        left_ms = expire_at_ms(NOW, SLICE_MS, RETENTION_MS) - time.time() * 1000
        assert abs(r.pttl(k) - left_ms) < 5000


@pytest.mark.parametrize("agg", ["count", "sum", "min", "max", "avg", "variance", "last", "first"])
def test_every_state_merges_over_what_was_stored(r: redis.Redis, agg: str) -> None:
    width = AGGS[agg].width
    first = [[3] * width, [1.5, 2.0, 0.25][:width] if width > 1 else [1.5]]
    key = slice_hash_key("m", f"{agg}")
    for token, vals in enumerate(first, start=1):
        numbers = [int(v) if agg == "count" else v for v in vals]
        assert _write(r, token, agg, [(key, NOW, numbers)])[0] == [1, 0, 0, 0]
    stored = r.hget(key, str(NOW)).split(b":")
    assert stored[0] == b"2" and len(stored) == width + 1
    # The merged numbers are what the read side's merge makes of the two states kept apart.
    apart = slice_hash_key("m", f"{agg}-apart")
    for token, (start, vals) in enumerate(zip((NOW - SLICE_MS, NOW), first, strict=True), start=1):
        numbers = [int(v) if agg == "count" else v for v in vals]
        assert _write(r, token, agg, [(apart, start, numbers)])[0] == [1, 0, 0, 0]
    want = AGGS[agg].merge(r.hmget(apart, [str(NOW - SLICE_MS), str(NOW)]))
    assert want[0] == 2 and [float(x) for x in stored[1:]] == pytest.approx(want[1:])


def test_slices_stored_in_the_old_text_are_merged(r: redis.Redis) -> None:
    """A hash written by the writer before number_text (17 digits, its own `_m`) is read and
    merged as any other: the stored text is only ever read as numbers."""
    key = slice_hash_key("m", "old")
    r.hset(key, mapping={str(NOW - SLICE_MS): "5:0.10000000000000001", str(NOW): "5:2.5",
                         "_m": f"{NOW}:{NOW - SLICE_MS}"})  # fmt: skip
    assert _write(r, 6, "sum", [(key, NOW, [0.2])])[0] == [1, 0, 0, 0]
    assert _read(r, key, "sum", NOW - SLICE_MS, NOW) == [2.0, 0.1 + 2.5 + 0.2]
    assert AGGS["sum"].merge(r.hmget(key, [str(NOW - SLICE_MS), str(NOW)])) == [2.0, 0.1 + 2.7]


def test_retention_drops_what_fell_behind(r: redis.Redis) -> None:
    key = slice_hash_key("m", "ret")
    # Its own clock, not the module's: a hash whose newest slice is a retention back expires by
    # Redis's clock soon after it, and the suite may reach this test minutes after the import.
    now = time.time_ns() // 1_000_000 // SLICE_MS * SLICE_MS
    old = now - RETENTION_MS
    assert _write(r, 1, "count", [(key, old, [1]), (key, old + SLICE_MS, [1])])[0] == [2, 0, 0, 0]
    # The newest slice moves on by a retention and a slice: `old` goes and an update of it
    # expires. `old + SLICE_MS` stays: a window as long as the retention, ending inside the newest
    # slice, still starts in it.
    assert _write(r, 2, "count", [(key, now + SLICE_MS, [1]), (key, old, [4])])[0] == [1, 0, 1, 0]
    assert set(r.hkeys(key)) == {str(old + SLICE_MS).encode(), str(now + SLICE_MS).encode(), b"_m"}
    # One slice more, and that one goes too.
    assert _write(r, 3, "count", [(key, now + 2 * SLICE_MS, [1])])[0] == [1, 0, 0, 0]
    assert set(r.hkeys(key)) == {str(now + SLICE_MS).encode(), str(now + 2 * SLICE_MS).encode(),
                                 b"_m"}  # fmt: skip


def test_a_key_ahead_of_the_writers_time_keeps_the_retention_before_that_time(
    r: redis.Redis,
) -> None:
    """An event stamped in the future (up to `source.max_future` ahead) makes a key's newest slice
    run ahead of now. The key still keeps every slice a window of the whole retention ending now
    starts in: from the retention before the writer's reference time, not before the newest."""
    now = time.time_ns() // 1_000_000 // SLICE_MS * SLICE_MS  # see the test above
    ahead, edge = now + 30 * 60_000, now - RETENTION_MS
    for key, ref, kept in [(slice_hash_key("m", "ahead"), now + 1_234, 3),
                           (slice_hash_key("m", "ahead-no-ref"), None, 2)]:  # fmt: skip
        assert _write(r, 1, "count", [(key, edge, [1]), (key, now, [1])], ref_ms=ref)[0] == [
            2, 0, 0, 0]  # fmt: skip
        # Without a reference time the key keeps the retention before its newest slice only.
        got = _write(r, 2, "count", [(key, ahead, [1]), (key, edge, [1])], ref_ms=ref)[0]
        assert got == ([2, 0, 0, 0] if ref else [1, 0, 1, 0])
        assert r.hlen(key) - 1 == kept
        assert _read(r, key, "count", edge, now)[-1] == (3 if ref else 1)  # the merged count
    key = slice_hash_key("m", "ahead")
    # The writer's time moves on by a slice: the edge slice falls behind the retention.
    assert _write(r, 3, "count", [(key, now + SLICE_MS, [1])], ref_ms=now + SLICE_MS)[0] == [
        1, 0, 0, 0]  # fmt: skip
    assert not r.hexists(key, str(edge))
    assert r.hget(key, "_m") == f"{ahead}:{edge + SLICE_MS}".encode()


def test_a_reply_that_does_not_add_up_fails_its_call(r: redis.Redis) -> None:
    key = slice_hash_key("m", "short")
    calls = build_calls(1, ("count", SLICE_MS, RETENTION_MS, 1), pa.array([key]),
                        np.array([NOW]), [pa.array(["1"])])  # fmt: skip
    lying = Calls(calls.payloads, calls.argv, [2], calls.row_call)  # claims two slices
    totals, failed = send_calls(r, lying)
    assert totals == [1, 0, 0, 0] and failed.tolist() == [True]


def test_replies_are_read_raw_from_the_socket(r: redis.Redis) -> None:
    """`read_replies`: replies cut across reads, an error reply returned (not raised) in its
    place, and a connection Redis closes raised as redis' ConnectionError."""
    import hiredis

    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        reader = hiredis.Reader(replyError=redis.exceptions.ResponseError)
        big = "x" * 3_000_000  # more than one read's bytes
        commands = [("SET", "raw:a", big), ("NOSUCHCOMMAND",), ("GET", "raw:a"), ("PING",)]
        conn.send_packed_command(conn.pack_commands(commands))
        ok, error = slice_writes.read_replies(conn, reader, 2)
        assert ok == b"OK" and isinstance(error, redis.exceptions.ResponseError)
        assert slice_writes.read_replies(conn, reader, 2) == [big.encode(), b"PONG"]
        conn.send_packed_command(conn.pack_commands([("QUIT",), ("PING",)]))
        assert slice_writes.read_replies(conn, reader, 1) == [b"OK"]
        with pytest.raises(redis.exceptions.ConnectionError):
            slice_writes.read_replies(conn, reader, 1)
    finally:
        conn.disconnect()
        pool.release(conn)


def test_calls_keep_to_one_slot_on_a_cluster(rc: Any) -> None:
    keys = [slice_hash_key("m", f"c{i}") for i in range(200)]
    rows = [(k, NOW, [1]) for k in keys]
    assert _write(rc, 1, "count", rows, cluster=True)[0] == [200, 0, 0, 0]
    assert _write(rc, 1, "count", rows, cluster=True)[0] == [0, 200, 0, 0]
    assert all(rc.hget(k, str(NOW)) == b"1:1" for k in keys)


def test_bounds_and_expiry_follow_a_model_through_random_batches(r: redis.Redis) -> None:
    """`_m` ("newest:oldest bound"), the stored slices and the expiry after each of many batches
    of random slices, late ones and ones past retention among them, against a model of the
    script's rules: `_m` is kept as text and rewritten only from the texts it is made of. Each
    batch has a reference time of its own (none in some), often behind a key's newest slice."""
    rng = np.random.default_rng(7)
    keys = [slice_hash_key("m", f"rnd{i}") for i in range(3)]
    model: dict[str, tuple[int, int, dict[int, int]]] = {}  # key -> (hi, lo, start -> count)
    span = np.arange(-RETENTION_MS // 2, 2 * RETENTION_MS, SLICE_MS) + NOW
    for token in range(1, 41):
        rows, want = [], [0, 0, 0, 0]
        ref = None if token % 5 == 0 else NOW + int(rng.integers(0, 2 * RETENTION_MS))
        for key in keys[: 1 + token % 3]:
            starts = sorted(set(rng.choice(span, size=int(rng.integers(1, 4))).tolist()))
            hi, lo, counts = model.get(key, (None, None, {}))
            hi = max(starts) if hi is None else max(hi, *starts)
            keep_from = hi if ref is None else min(hi, ref - ref % SLICE_MS)
            keep_from -= RETENTION_MS
            lo = float("inf") if lo is None else lo
            for s in starts:
                rows.append((key, s, [1]))
                if s < keep_from:
                    want[2] += 1
                    continue
                want[0] += 1
                counts[s] = counts.get(s, 0) + 1
                lo = min(lo, s)
            if lo < keep_from:
                counts = {s: c for s, c in counts.items() if s >= keep_from}
                lo = keep_from
            model[key] = (hi, int(lo), counts)
        assert _write(r, token, "count", rows, ref_ms=ref)[0] == want
        for key, (hi, lo, counts) in model.items():
            assert r.hget(key, "_m") == f"{hi}:{lo}".encode()
            stored = {int(f): int(v.split(b":")[1]) for f, v in r.hgetall(key).items()
                      if f != b"_m"}  # fmt: skip
            assert stored == counts
            left_ms = expire_at_ms(hi, SLICE_MS, RETENTION_MS) - time.time() * 1000
            assert abs(r.pttl(key) - left_ms) < 5000


def _backfill(client: Any, seam: int, agg: str, rows: list[tuple[str, int, list[Any]]],
              cluster: bool = False, restore: bool = False,
              ref_ms: int | None = None) -> list[int]:  # fmt: skip
    """Slices written as a backfill writes them (token `b<seam>`): through the script only, or
    with RESTORE for the hashes that do not exist yet (`slice_restore`), as backfills do."""
    if not restore:
        return _write(client, f"b{seam}", agg, rows, cluster, ref_ms)[0]  # type: ignore[arg-type]
    a = AGGS[agg]
    keys = pa.array([k for k, _, _ in rows], pa.string())
    starts = np.array([s for _, s, _ in rows], dtype=np.int64)
    states = [pc.cast(pa.array([v[j] for _, _, v in rows]), pa.string()) for j in range(a.width)]
    head = (a.state, SLICE_MS, RETENTION_MS, a.width)
    plan = plan_restores(f"b{seam}", head, keys, starts, states, cluster, ref_ms=ref_ms)
    totals, failed = plan.run(client)
    assert not failed.any()
    return totals


BACKFILL_PATHS = pytest.mark.parametrize("restore", [False, True], ids=["script", "restore"])


@BACKFILL_PATHS
@pytest.mark.parametrize("cluster", [False, True])
def test_a_backfill_replaces_below_its_seam_and_the_live_fold_keeps_off(
    r: redis.Redis, rc: Any, cluster: bool, restore: bool
) -> None:
    """The seam rule of docs/offline.md, on the script: a backfill's slices replace what is
    stored (a re-run writes the same), each key's `_b` rises to the seam and never falls, and
    the live fold's later updates of a slice before it are skipped and counted, while its
    updates at or after the seam merge as before."""
    client = rc if cluster else r
    seam = NOW - 10 * SLICE_MS
    one, many = slice_hash_key("bf", f"one{cluster}"), slice_hash_key("bf", f"many{cluster}")
    live_first = [(many, seam - 3 * SLICE_MS, [5]), (many, seam, [7])]
    assert _write(client, 1, "count", live_first, cluster)[0] == [2, 0, 0, 0]
    archive = [(one, seam - SLICE_MS, [3]), (many, seam - 3 * SLICE_MS, [4]),
               (many, seam - 2 * SLICE_MS, [1])]  # fmt: skip
    for _ in range(2):  # a re-run leaves the same store
        assert _backfill(client, seam, "count", archive, cluster, restore) == [3, 0, 0, 0]
        assert client.hget(many, str(seam - 3 * SLICE_MS)) == b"0:4"  # replaced, not 5 + 4
        assert client.hget(many, str(seam)) == b"1:7"  # the live fold's, untouched
        assert client.hget(one, str(seam - SLICE_MS)) == b"0:3"
        for key in (one, many):
            assert client.hget(key, "_b") == str(seam).encode()
    assert client.hget(many, "_m") == f"{seam}:{seam - 3 * SLICE_MS}".encode()
    late = [(one, seam - SLICE_MS, [1]), (one, seam, [2]), (many, seam - 2 * SLICE_MS, [1])]
    assert _write(client, 2, "count", late, cluster)[0] == [1, 0, 0, 2]
    assert client.hget(one, str(seam - SLICE_MS)) == b"0:3"
    assert client.hget(one, str(seam)) == b"2:2"
    assert _backfill(client, seam - SLICE_MS, "count", [(one, seam - 2 * SLICE_MS, [9])],
                     cluster, restore) == [1, 0, 0, 0]  # fmt: skip
    assert client.hget(one, "_b") == str(seam).encode()  # a seam never moves back
    later = seam + SLICE_MS
    assert _backfill(client, later, "count", [(one, seam, [6])], cluster, restore) == [1, 0, 0, 0]
    assert client.hget(one, "_b") == str(later).encode()
    assert client.hget(one, str(seam)) == b"0:6"


@BACKFILL_PATHS
def test_a_backfill_keeps_retention(r: redis.Redis, restore: bool) -> None:
    key = slice_hash_key("bf", "old")
    seam = NOW + SLICE_MS
    rows = [(key, NOW, [1]), (key, NOW - RETENTION_MS - SLICE_MS, [1])]
    assert _backfill(r, seam, "count", rows, restore=restore) == [1, 0, 1, 0]
    assert set(r.hkeys(key)) == {str(NOW).encode(), b"_m", b"_b"}
    assert r.pttl(key) > 0


@BACKFILL_PATHS
def test_a_backfill_keeps_what_a_key_ahead_of_now_still_answers(
    r: redis.Redis, restore: bool
) -> None:
    """The live fold wrote a key's slice half an hour ahead (an event stamped in the future). A
    backfill up to now keeps the key's slices from the retention before now, as the live fold
    does: a window of the whole retention ending now starts there."""
    now = time.time_ns() // 1_000_000 // SLICE_MS * SLICE_MS
    ahead, edge = now + 30 * 60_000, now - RETENTION_MS
    key = slice_hash_key("bf", f"ahead{restore}")
    assert _write(r, 1, "count", [(key, ahead, [1])], ref_ms=now)[0] == [1, 0, 0, 0]
    rows = [(key, edge - SLICE_MS, [1]), (key, edge, [2]), (key, now - SLICE_MS, [3])]
    assert _backfill(r, now, "count", rows, restore=restore, ref_ms=now) == [2, 0, 1, 0]
    assert r.hget(key, str(edge)) == b"0:2" and r.hget(key, "_m") == f"{ahead}:{edge}".encode()
    # A new hash from a backfill keeps what the live fold would: from the retention before now.
    fresh = slice_hash_key("bf", f"fresh{restore}")
    assert _backfill(r, now, "count", [(fresh, edge, [4])], restore=restore, ref_ms=now + 1) == [
        1, 0, 0, 0]  # fmt: skip


@pytest.mark.parametrize("token", [3, f"b{NOW + SLICE_MS}"], ids=["live", "backfill"])
def test_a_key_with_thousands_of_slices_in_one_call(r: redis.Redis, token: Any) -> None:
    """A backfill hands a key's whole history to one partition (a month of 10 s slices is
    259,200), and a replay after an outage can carry hours of one key: its slices go in runs
    that Lua can unpack, in as many calls as Redis takes."""
    a, n, day = AGGS["count"], 5_000, 86_400_000
    key = slice_hash_key("long", str(token))
    starts = NOW - SLICE_MS * np.arange(n, dtype=np.int64)
    states = [pc.cast(pa.array(np.arange(1, n + 1)), pa.string())]
    calls = build_calls(token, (a.state, SLICE_MS, day, a.width), pa.array([key] * n), starts,
                        states)  # fmt: skip
    totals, failed = send_calls(r, calls)
    assert totals == [n, 0, 0, 0] and not failed.any()
    script = r.register_script(script_source(READ_SLICES))
    got = script(keys=[key], args=[a.state, NOW - day + SLICE_MS, NOW, SLICE_MS])
    assert [int(x) for x in got] == [n, n * (n + 1) // 2]
    assert r.hget(key, "_m") == f"{NOW}:{NOW - (n - 1) * SLICE_MS}".encode()


def test_items_with_thousands_of_slices_through_the_list_writer(r: redis.Redis) -> None:
    a, n, day = AGGS["sum"], 5_000, 86_400_000
    key = slice_hash_key("long", "items")
    body = [str(x) for s in range(n) for x in (NOW - s * SLICE_MS, s)]
    failed: set[Any] = set()
    item = (key, [a.state, str(SLICE_MS), str(day), str(n), str(a.width), *body], ("dep",))
    assert run_write_script(r, 5, [item], failed) == [n, 0, 0, 0] and not failed
    assert r.hlen(key) == n + 1
    assert r.hget(key, str(NOW - (n - 1) * SLICE_MS)) == f"5:{n - 1}".encode()
