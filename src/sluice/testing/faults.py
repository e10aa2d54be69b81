"""Store faults for tests and benchmarks, injected from outside the product.

A fold writes each partition with `FoldQuery.writer` (default `pipeline.writer.write_partition`,
run on the executors). These are wrappers of it: install one with `fold.writer = LoseOne(...)`,
and put `write_partition` back to heal the store. Each is a plain, picklable callable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from sluice.pipeline.writer import RESULT_SCHEMA, WriterContext, write_partition


def _drop_rows(batches: Iterator[pa.RecordBatch], keep: object) -> Iterator[pa.RecordBatch]:
    """`batches` without the folded rows for which `keep(i)` is False (i counts every row)."""
    seen = 0
    for b in batches:
        mask = [bool(keep(seen + i)) for i in range(b.num_rows)]  # type: ignore[operator]
        seen += b.num_rows
        yield b.filter(pa.array(mask, type=pa.bool_()))


def _first_to_claim(url: str, claim_key: str, then: Callable[[Any], None] | None = None) -> bool:
    """Whether this partition is the first of the run to claim `claim_key` in Redis at `url`
    (once, whatever the partitions and the processes); `then` runs with the client if so."""
    from sluice.redis.connection import client_for

    client = client_for(url)
    try:
        won = bool(client.set(claim_key, 1, nx=True, ex=3600))
        if won and then is not None:
            then(client)
        return won
    finally:
        client.close()


@dataclass(frozen=True)
class LoseOne:
    """The store loses one slice update: the first partition to claim `claim_key` (once in
    Redis at `url`, for the whole run) drops its first folded row before writing."""

    url: str
    claim_key: str

    def __call__(
        self, ctx: WriterContext, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        rows = [b for b in batches if b.num_rows]
        if rows and _first_to_claim(self.url, self.claim_key):
            rows = list(_drop_rows(iter(rows), lambda i: i != 0))
        yield from write_partition(ctx, iter(rows))


@dataclass(frozen=True)
class RemoveFirst:
    """An entry leaves the log after its batch was planned and read, as one a Redis failover
    lost would: the first partition to claim `claim_key` deletes the oldest entry of `shard`
    and writes nothing, so that the batch does not balance and is read again."""

    url: str
    claim_key: str
    shard: str

    def __call__(
        self, ctx: WriterContext, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        rows = [b for b in batches if b.num_rows]
        if rows and _first_to_claim(self.url, self.claim_key, self._remove_oldest):
            rows = []
        yield from write_partition(ctx, iter(rows))

    def _remove_oldest(self, client: Any) -> None:
        ((oldest, _),) = client.xrange(self.shard, count=1)
        client.xdel(self.shard, oldest)


@dataclass(frozen=True)
class DropEvery:
    """A store that loses every `n`-th folded row of every partition."""

    n: int

    def __call__(
        self, ctx: WriterContext, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        yield from write_partition(ctx, _drop_rows(batches, lambda i: (i + 1) % self.n != 0))


@dataclass(frozen=True)
class SlowStore:
    """A slow store: `ms_per_1000` ms more per 1,000 slice updates applied, which shows in the
    partition's write time as it would from a slow Redis."""

    ms_per_1000: float

    def __call__(
        self, ctx: WriterContext, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        for out in write_partition(ctx, batches):
            rows = out.to_pylist()
            for row in rows:
                if row["kind"] == "stats" and row["updates_applied"]:
                    extra_ms = self.ms_per_1000 * row["updates_applied"] / 1000
                    time.sleep(extra_ms / 1000)
                    row["write_ms"] = (row["write_ms"] or 0.0) + extra_ms
            yield pa.RecordBatch.from_pylist(rows, schema=out.schema)


@dataclass(frozen=True)
class PauseBetweenMetrics:
    """A store that takes `pause_s` between one metric's writes and the next's, so that a
    reader meets a batch's write half done: each metric of the partition is written by its own
    `write_partition`, and the first one's record is kept, with every one's updates summed."""

    pause_s: float

    def __call__(
        self, ctx: WriterContext, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from sluice.redis import marks
        from sluice.redis.connection import client_for

        rows = [b for b in batches if b.num_rows]
        records: list[list[dict[str, Any]]] = []
        client = client_for(ctx.url)
        try:  # one write, as the task's is: marked from the first metric's to the last's
            task = TaskContext.get()
            part = f"paused-{task.partitionId() if task is not None else 'd'}"
            with marks.writing(client, ctx.token, part):
                for i, sp in enumerate(ctx.specs):
                    if i:
                        time.sleep(self.pause_s)
                    out = write_partition(dataclasses.replace(ctx, specs=(sp,)), iter(rows))
                    records.append([r for b in out for r in b.to_pylist()])
        finally:
            client.close()
        first = records[0]
        for later in records[1:]:
            stats = next(r for r in later if r["kind"] == "stats")
            for r in first:
                if r["kind"] == "stats":
                    for name in ("updates_applied", "updates_duplicate", "updates_expired"):
                        r[name] += stats[name]
        yield pa.RecordBatch.from_pylist(first, schema=RESULT_SCHEMA)
