"""Write-behind with real Spark and real Redis (`pipeline.behind`): a batch is written from the
driver while the next one folds, and nothing is lost or counted twice: not when the writes run
behind, not when the process dies between a batch's commit and its write. (A write whose audit
fails behind the query, in place or after a restart: tests/integration/test_audit.py.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import redis

from sluice.pipeline.behind import logged_batches, read_mark
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.writer import WriterContext, write_partition
from sluice.redis.connection import RedisHandle
from sluice.status.snapshot import recent_batches
from tests.conftest import wait_until
from tests.integration.test_audit import _cfg, _produce, _stats, _stored_count

BEHIND = {"single_task_events": 0, "write_behind": "on"}  # every batch is written behind


def _run_until_idle(fold: FoldQuery) -> FoldQuery:
    """Start `fold`, wait until its input is drained and no batch runs, and stop it."""
    fold.start()
    try:
        assert fold.wait_idle(120)
    finally:
        fold.stop()
    return fold


def test_every_batch_written_behind_balances_and_counts_exactly(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, spark=BEHIND, source={"max_events_per_batch": 300})
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    assert p.behind is not None
    sent = _produce(r, 30, 50, bad_every=97)
    p.start()
    try:
        assert p.wait_idle(120)
    finally:
        p.stop()
    st = _stats(r)
    batches = int(st["batches"])
    assert batches >= 4 and int(st["audit_ok"]) == batches and "audit_failed" not in st
    assert int(st["events_admitted"]) == int(st["events_in"]) == sent
    assert int(st["dead_bad_json"]) == int(st["dead_letters"]) > 0
    assert _stored_count(r) == int(st["events_aggregated"])
    # The fold released every written batch; the mark is the newest committed batch.
    assert r.xlen("events:0") + r.xlen("events:1") <= 2  # a shard keeps its committed entry
    assert read_mark(p.ckpt) == logged_batches(p.ckpt, "commits")[-1]
    records = recent_batches(r, 100)
    assert len(records) == batches and all(rec["behind"] for rec in records)
    assert all(rec["wait_ms"] >= 0 and rec["write_ms"] > 0 for rec in records)


class _Stalls:
    """A store whose first write stalls until `go` is set, then fails: the process 'dies'
    while Spark has already committed the batch."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.calls = 0

    def __call__(
        self, ctx: WriterContext, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        self.calls += 1
        if self.calls == 1:
            self.started.set()
            self.go.wait(120)
            raise ConnectionError("the process died before its write")
        yield from write_partition(ctx, batches)


def test_a_batch_committed_but_not_written_runs_again_on_the_next_start(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, spark=BEHIND)
    sent = _produce(r, 10, 40)
    first = FoldQuery(cfg, RedisHandle(redis_url), spark)
    stall = _Stalls()
    first.writer = stall
    first.start()
    try:
        assert stall.started.wait(120)
        wait_until(lambda: logged_batches(first.ckpt, "commits") == [0], 60, "batch 0's commit")
        # Committed, not written, and its input kept: the source did not release it.
        assert read_mark(first.ckpt) == -1
        assert r.xlen("events:0") + r.xlen("events:1") == 10
        assert "events_in" not in _stats(r)
        first.query.stop()  # type: ignore[union-attr]
    finally:
        stall.go.set()
        first.stop()
    assert logged_batches(first.ckpt, "commits") == [0] and read_mark(first.ckpt) == -1

    second = _run_until_idle(FoldQuery(cfg, RedisHandle(redis_url), spark))
    st = _stats(r)
    assert int(st["events_in"]) == sent == _stored_count(r)
    assert int(st["audit_ok"]) == int(st["batches"]) == 1  # batch 0, once, by the second run
    assert logged_batches(second.ckpt, "commits") == [0] and read_mark(second.ckpt) == 0
    assert r.xlen("events:0") + r.xlen("events:1") <= 2
    assert second.behind is not None and second.behind.idle


def test_a_batch_whose_release_failed_after_its_write_is_skipped_when_spark_runs_it_again(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A batch written in its own task (a small one) is marked written, then its input is
    released; a release that fails (a master down) fails the batch after its write, so Spark
    commits nothing and runs it again. The shards released before the failure are trimmed: the
    batch is skipped, not read short and audited against its logged source side (which failed
    an attempt before)."""
    small = {"single_task_events": 1_000_000, "write_behind": "on"}
    cfg = _cfg(redis_url, tmp_path, spark=small, source={"max_events_per_batch": 200})
    sent = _produce(r, 12, 40)
    first = FoldQuery(cfg, RedisHandle(redis_url), spark)
    release = first._release
    calls: list[int] = []

    def fails_once(end: dict[str, Any]) -> None:
        calls.append(1)
        if len(calls) == 2:  # batch 1's: after its write and its mark
            release({**end, "ids": {s: p for s, p in end["ids"].items() if s == "events:0"}})
            raise redis.ConnectionError("the master of events:1 is down")
        release(end)

    first._release = fails_once  # type: ignore[method-assign]
    first.start()
    try:
        wait_until(lambda: first.query is not None and not first.query.isActive, 120,
                   "the batch that failed its release")  # fmt: skip
    finally:
        first.stop()
    assert read_mark(first.ckpt) == 1 and logged_batches(first.ckpt, "commits") == [0]

    second = _run_until_idle(FoldQuery(cfg, RedisHandle(redis_url), spark))
    st = _stats(r)
    assert "audit_failed" not in st
    assert int(st["audit_ok"]) == int(st["batches"]) >= 3
    assert int(st["events_in"]) == int(st["events_admitted"]) == sent == _stored_count(r)
    assert read_mark(second.ckpt) == logged_batches(second.ckpt, "commits")[-1]


def test_a_batch_written_whose_commit_was_lost_is_skipped_when_spark_runs_it_again(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The writer thread can finish a batch (written, audited, recorded, its input released)
    before Spark writes the batch's commit. If the query ends in between, Spark runs the batch
    again from its offset log; its input is gone, so it must be skipped, not audited again
    (which would fail against the released input and count a failed attempt)."""
    cfg = _cfg(redis_url, tmp_path, spark=BEHIND, source={"max_events_per_batch": 200})
    sent = _produce(r, 12, 40)
    first = _run_until_idle(FoldQuery(cfg, RedisHandle(redis_url), spark))
    before = _stats(r)
    newest = logged_batches(first.ckpt, "commits")[-1]
    assert newest >= 1 and read_mark(first.ckpt) == newest
    for name in (str(newest), f".{newest}.crc"):  # the commit Spark did not get to write
        (first.ckpt / "commits" / name).unlink(missing_ok=True)

    second = FoldQuery(cfg, RedisHandle(redis_url), spark)
    second.start()
    try:
        wait_until(lambda: logged_batches(second.ckpt, "commits")[-1] == newest, 120,
                   "the batch's commit")  # fmt: skip
    finally:
        second.stop()
    st = _stats(r)
    assert "audit_failed" not in st
    assert st == before  # nothing recorded twice
    assert int(st["events_in"]) == sent == _stored_count(r)
    assert read_mark(second.ckpt) == newest
