"""The store writer: slice updates -> Redis, idempotent per batch.

Runs inside `mapInArrow` on the executors, so the writes go straight from the tasks to Redis and
only a few counters come back to the driver; under write-behind (`pipeline.behind`) the driver
runs it on a batch's collected updates. Within one partition, a metric's script calls go out
from a sender thread while the next metric's calls are built.

Idempotency. Every write carries a *token* = epoch * 10**12 + batch_id
(`query.writer_token`). `epoch` is a counter taken once per fresh checkpoint (see
`query.writer_epoch`), so tokens only grow across the life of a deployment. The slice-write
script stores the token beside each slice's state and skips an update whose token is not newer
than the stored one, atomically with the merge. A batch that Spark
re-runs after a crash has the same batch id and offsets, hence the same updates and token: slices
that the failed attempt already wrote are skipped, the rest are applied. Dead letters are guarded
the same way, by a marker per (token, content digest) set in the same script as the XADDs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext

from sluice import collector
from sluice.graph import ALL_SHARDS
from sluice.pipeline.plan import DEAD_G, MetricSpec
from sluice.pipeline.slice_restore import mostly_stored, plan_restores
from sluice.pipeline.slice_writes import (
    REPLY_COUNTS,
    build_calls,
    run_write_script,
    send_calls,
)
from sluice.redis import marks
from sluice.redis.connection import client_for
from sluice.redis.dump import ZIPLIST_LIMITS
from sluice.redis.keys import (
    SEAMS_KEY,
    dead_letter_marker_key,
    dead_letter_stream_key,
    slice_hash_key,
    slice_hll_key,
)
from sluice.redis.loading import wait_while_loading
from sluice.redis.scripts import DEAD_LETTERS, script_source
from sluice.slices.aggs import AGGS, BLOB, HLL
from sluice.source.values import DECODE_REASONS

# What every reader of an entry finds alike, so one of them records it: not `lost_records`,
# which each finds by its own lag.
RECORDED_ONCE = frozenset(DECODE_REASONS) - {"lost_records"}

UPDATE_COUNTS = ("updates_applied", "updates_duplicate", "updates_expired", "updates_before_seam")
PIPELINE_CHUNK = 50
DEAD_MARKER_TTL_S = 7 * 86400
MASK64 = (1 << 64) - 1

RESULT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("m", pa.int32()),
        ("updates_applied", pa.int64()),
        ("updates_duplicate", pa.int64()),
        ("updates_expired", pa.int64()),
        ("updates_before_seam", pa.int64()),
        ("events", pa.int64()),
        ("fold_rows", pa.int64()),
        ("fold_cells", pa.int64()),
        ("min_ems", pa.int64()),
        ("max_ems", pa.int64()),
        ("reason", pa.string()),
        ("write_ms", pa.float64()),
        ("fan_x", pa.int64()),
        ("applied_x", pa.int64()),
    ]
)
RESULT_DDL = (
    "kind string, m int, updates_applied long, updates_duplicate long, updates_expired long,"
    " updates_before_seam long,"
    " events long, fold_rows long, fold_cells long,"
    " min_ems long, max_ems long, reason string, write_ms double, fan_x long, applied_x long"
)


@dataclass(frozen=True)
class WriterContext:
    url: str  # a plain or a cluster URL (`sluice.redis.connection.client_for`)
    token: int
    specs: tuple[MetricSpec, ...]
    source_stream: str
    dead_letter_maxlen: int
    cluster: bool = False  # Redis Cluster: a script call carries keys of one slot only
    # The slice script's token argument when it is not `token`: a backfill's `b<seam>`, whose
    # slices replace the stored ones below the seam (write_slices.lua, sluice.offline.backfill).
    script_token: str | None = None
    # A backfill's hashes that do not exist yet are created whole with RESTORE (slice_restore),
    # as ziplists within the server's (hash-max-ziplist-entries, hash-max-ziplist-value).
    restore_new: bool = True
    ziplist: tuple[int, int] = ZIPLIST_LIMITS
    # The writer's reference time (ms): a key keeps its slices from a retention before its
    # newest slice, or before this time's slice where the newest is ahead of it (an event
    # stamped in the future; `slice_writes.keep_from_ms`). None: before its newest slice.
    ref_ms: int | None = None
    # The input shards whose undecodable entries this reader records (`Role.recorded_shards`;
    # None: all of them). Another reader records those of the others; this one still writes
    # its own reasons (a fold's `future` and `expired`, a reader's `lost_records`), and its
    # counts by reason are the same either way.
    recorded_shards: frozenset[str] | None = None


def backfill_seams(client: Any, specs: Sequence[MetricSpec]) -> dict[str, int]:
    """The seams a backfill recorded for `specs`' metrics (`sluice:{backfill}:seams`). Before
    a seam the archive is the truth: the live fold skips its updates of slices before it
    (counted as before seam), whether or not the key's hash holds the seam (`_b`) yet, and for
    every state alike (a distinct's HyperLogLogs as a count's slices)."""
    names = sorted({sp.name for sp in specs})
    got = client.hmget(SEAMS_KEY, names) if names else []
    return {n: int(v) for n, v in zip(names, got, strict=True) if v is not None}


class PartitionRows:
    """One writer partition's folded rows, as columns (see `plan.fold_updates`), and which of
    them the store failed to take (`failed`, for the audit's applied side)."""

    def __init__(self, batches: Iterator[pa.RecordBatch]) -> None:
        self.seams: dict[str, int] = {}  # per metric, the live fold's (`backfill_seams`)
        self.before_seam = 0  # updates of slices before their metric's seam, skipped
        got = [b for b in batches if b.num_rows]
        self.table = pa.Table.from_batches(got).combine_chunks() if got else None
        self.n = 0 if self.table is None else self.table.num_rows
        self.failed = np.zeros(self.n, dtype=bool)
        self.g = np.zeros(0, np.int32) if self.table is None else self.col("g").to_numpy()
        self.k_valid = (
            np.zeros(0, bool)
            if self.table is None
            else self.col("k").is_valid().to_numpy(zero_copy_only=False)
        )

    def col(self, name: str) -> Any:
        assert self.table is not None
        return self.table.column(name).chunk(0) if self.table.column(name).num_chunks else None

    def rows_of(self, sp: MetricSpec) -> np.ndarray:
        """The rows that carry an update of `sp`: its group's, with a key and a value, and not
        of a slice before the metric's seam (those are counted in `before_seam`)."""
        n = np.nan_to_num(self.col(sp.column("n")).to_numpy(zero_copy_only=False))
        idx = np.flatnonzero((self.g == sp.group) & self.k_valid & (n > 0))
        seam = self.seams.get(sp.name)
        if seam is None or not len(idx):
            return idx
        after = self.col("s").to_numpy(zero_copy_only=False)[idx] >= seam
        self.before_seam += int(len(idx) - after.sum())
        return idx[after]

    def stats(self) -> dict[str, Any]:
        """Good events, the exploded rows folded and the cells (rows here) they folded into,
        event-time range, and the audit's fan-out and applied XORs."""
        out: dict[str, Any] = {"events": 0, "fold_rows": 0, "fold_cells": self.n,
                               "min_ems": None, "max_ems": None,
                               "fan_x": None, "applied_x": None}  # fmt: skip
        if self.table is None:
            return out
        cnt = self.col("cnt").to_numpy(zero_copy_only=False)
        out["events"] = int(cnt[self.g == 0].sum())
        out["fold_rows"] = int(cnt.sum())
        out["min_ems"] = pc.min(self.col("min_ems")).as_py()
        out["max_ems"] = pc.max(self.col("max_ems")).as_py()
        if "ux" in self.table.column_names:
            fx = self.col("fx").to_numpy(zero_copy_only=False).view(np.uint64)
            ux = self.col("ux").to_numpy(zero_copy_only=False).view(np.uint64)
            out["fan_x"] = _signed(int(np.bitwise_xor.reduce(fx)) if len(fx) else 0)
            ok = ux[~self.failed]
            out["applied_x"] = _signed(int(np.bitwise_xor.reduce(ok)) if len(ok) else 0)
        return out


def write_partition(
    ctx: WriterContext, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: apply every slice update of this partition, yield counters."""
    collector.settle()
    rows = PartitionRows(batches)
    client = client_for(ctx.url, timeout_s=60, connect_timeout_s=10)
    t0 = time.perf_counter()
    try:
        # Redis loading its dataset (a restart) refuses every write: wait and write the whole
        # partition again. Exact: a slice or dead letter already written holds this token.
        what = f"the writer of token {ctx.token}"
        totals, reasons = wait_while_loading(lambda: _write_marked(client, ctx, rows), what)
    finally:
        client.close()
    write_ms = (time.perf_counter() - t0) * 1000
    out: list[dict[str, Any]] = [
        {
            "kind": "stats",
            "write_ms": write_ms,
            "updates_applied": totals[0],
            "updates_duplicate": totals[1],
            "updates_expired": totals[2],
            "updates_before_seam": totals[3],
            **rows.stats(),
        }
    ]
    out += [{"kind": "dead", "reason": r, "events": n} for r, n in reasons.items()]
    yield pa.RecordBatch.from_pylist(out, schema=RESULT_SCHEMA)


def _write_marked(
    client: Any, ctx: WriterContext, rows: PartitionRows
) -> tuple[list[int], dict[str, int]]:
    """`_write_rows`, marked for reads that need one state (`redis.marks`)."""
    with _marked(client, ctx):
        return _write_rows(client, ctx, rows)


def _marked(client: Any, ctx: WriterContext) -> AbstractContextManager[None]:
    """A live batch's write marked by its token and this task's partition (the driver's, under
    write-behind); a backfill's is not marked (docs/metrics.md, "Derived metrics")."""
    if ctx.script_token is not None:
        return nullcontext()
    task = TaskContext.get()
    return marks.writing(client, ctx.token, "d" if task is None else str(task.partitionId()))


def _write_rows(
    client: Any, ctx: WriterContext, rows: PartitionRows
) -> tuple[list[int], dict[str, int]]:
    """One attempt at writing the partition: the [applied, duplicate, expired, before seam]
    totals and the dead letters by reason. Safe to repeat (see the module docstring)."""
    rows.failed[:] = False
    rows.before_seam = 0
    rows.seams = backfill_seams(client, ctx.specs) if rows.table is not None else {}
    totals = [0] * REPLY_COUNTS
    dead: list[str] = []
    if rows.table is not None:
        # A metric's script calls go out from a sender thread while the next metric's are
        # built here (Arrow kernels and socket waits let go of the GIL); the client is used
        # by one thread at a time: the other states are written once the scripts are done.
        parts: list[list[int]] = []
        with ThreadPoolExecutor(1, thread_name_prefix="sluice-send") as sender:
            pending = [
                apply_lua(client, ctx, rows, sp, sender) for sp in ctx.specs if AGGS[sp.agg].lua
            ]
            parts += [done() for done in pending]
        for sp in ctx.specs:
            if AGGS[sp.agg].lua:
                continue
            if AGGS[sp.agg].state == HLL:
                parts.append([apply_hll(client, rows, sp), 0, 0, 0])
            else:
                parts.append(_apply_blob(client, ctx, rows, sp))
        totals = [sum(p[j] for p in parts) for j in range(REPLY_COUNTS)]
        totals[3] += rows.before_seam
        dead = rows.col("k").filter(pa.array(rows.g == DEAD_G)).to_pylist()
    reasons = write_dead_letters(client, ctx, dead) if dead else {}
    return totals, reasons


def _signed(x: int) -> int:
    """An unsigned 64-bit id as Spark's signed long (same bits)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def apply_lua(
    client: Any, ctx: WriterContext, rows: PartitionRows, sp: MetricSpec, sender: Executor
) -> Callable[[], list[int]]:
    """A Lua-merged state: every update of `sp` in this partition, built on columns
    (`slice_writes`) and sent by `sender`. Returns a call that waits for the replies, marks the
    rows of a call that failed in `rows.failed` and returns [applied, duplicate, expired, before
    seam]."""
    idx = rows.rows_of(sp)
    if not len(idx):
        return lambda: [0] * REPLY_COUNTS
    agg = AGGS[sp.agg]
    assert agg.numbers is not None
    take = pa.array(idx)
    prefix = slice_hash_key(sp.name, "\x00", sp.resolution_ms).split("\x00")
    keys = pc.binary_join_element_wise(prefix[0], rows.col("k").take(take), prefix[1], "")
    folded = [rows.col(sp.column(f.column)).take(take) for f in agg.folds]
    states = agg.encode(rows.col(sp.column("n")).take(take), *folded)
    starts = rows.col("s").take(take).to_numpy(zero_copy_only=False)
    head = (agg.state, sp.slice_ms, sp.retention_ms, agg.width)
    token = ctx.token if ctx.script_token is None else ctx.script_token
    if ctx.script_token is not None and ctx.restore_new and not mostly_stored(client, keys):
        plan = plan_restores(ctx.script_token, head, keys, starts, states, ctx.cluster,
                             ctx.ziplist, ctx.ref_ms)  # fmt: skip
        restored = sender.submit(plan.run, client)

        def done_restored() -> list[int]:
            totals, failed = restored.result()
            rows.failed[idx[failed]] = True
            return totals

        return done_restored
    calls = build_calls(token, head, keys, starts, states, ctx.cluster, ctx.ref_ms)
    sent = sender.submit(send_calls, client, calls)

    def done() -> list[int]:
        totals, failed = sent.result()
        rows.failed[idx[failed[calls.row_call]]] = True
        return totals

    return done


def apply_hll(client: Any, rows: PartitionRows, sp: MetricSpec) -> int:
    """distinct: PFADD each slice's values into its HyperLogLog. PFADD is idempotent, so a re-run
    batch adds nothing twice and needs no token."""
    idx = rows.rows_of(sp)
    take = pa.array(idx)
    ks = rows.col("k").take(take).to_pylist()
    ss = rows.col("s").take(take).to_pylist()
    sets = rows.col(sp.column("set")).take(take).to_pylist()
    pipe = client.pipeline(transaction=False)
    for n, (k, s, values) in enumerate(zip(ks, ss, sets, strict=True), start=1):
        key = slice_hll_key(sp.name, k, s, sp.resolution_ms)
        for j in range(0, len(values), 10_000):
            pipe.pfadd(key, *values[j : j + 10_000])
        pipe.pexpireat(key, s + sp.slice_ms + sp.retention_ms)
        if n % PIPELINE_CHUNK == 0:
            pipe.execute()
    pipe.execute()
    return len(ks)


def _apply_blob(client: Any, ctx: WriterContext, rows: PartitionRows, sp: MetricSpec) -> list[int]:
    """Blob states (quantile's sketches): merge each slice's blob into the stored one with the
    agg's `union`, then write it back guarded by the writer token (a slice already holding this
    batch's token is left alone)."""
    idx = rows.rows_of(sp)
    if not len(idx):
        return [0] * REPLY_COUNTS
    union = AGGS[sp.agg].union
    if union is None:
        raise ValueError(f"agg {sp.agg!r} has no blob union")
    take = pa.array(idx)
    cells: dict[str, list[tuple[int, bytes, int]]] = {}
    folded = rows.col(sp.column(AGGS[sp.agg].folds[0].column)).take(take).to_pylist()
    for row, k, s, value in zip(
        idx.tolist(), rows.col("k").take(take).to_pylist(),
        rows.col("s").take(take).to_pylist(), folded, strict=True,
    ):  # fmt: skip
        cells.setdefault(k, []).append((s, bytes(value), row))
    items = list(cells.items())
    pipe = client.pipeline(transaction=False)
    for k, kc in items:
        pipe.hmget(slice_hash_key(sp.name, k, sp.resolution_ms), [str(s) for s, _, _ in kc])
    calls = []
    dups = 0
    row_of: dict[tuple[Any, ...], list[int]] = {}
    for (k, kc), olds in zip(items, pipe.execute(), strict=True):
        flat: list[Any] = []
        for (s, value, row), old in zip(kc, olds, strict=True):
            if old is not None:
                token, _, old_value = old.partition(b":")
                if int(token) >= ctx.token:
                    dups += 1
                    continue
                value = union([old_value, value]) or value  # never None: two blobs in
            flat += [str(s), value]
            row_of.setdefault(("l", sp.index, k), []).append(row)
        if flat:
            head = [BLOB, str(sp.slice_ms), str(sp.retention_ms), str(len(flat) // 2), "1"]
            key = slice_hash_key(sp.name, k, sp.resolution_ms)
            calls.append((key, [*head, *flat], ("l", sp.index, k)))
    failed: set[tuple[Any, ...]] = set()
    totals = run_write_script(client, ctx.token, calls, failed, ctx.cluster, ctx.ref_ms)
    for dep in failed:
        rows.failed[row_of[dep]] = True
    totals[1] += dups
    return totals


def records(shards: frozenset[str] | None, rec: dict[str, Any]) -> bool:
    """Whether a reader that records the undecodable entries of `shards` (None: of every
    shard) writes the dead letter `rec`. An entry of a reader of several shards is named
    `<shard>@<id>`, a Kafka record `<topic>:<partition>@<offset>` (its topic's shards are one,
    ALL_SHARDS); a reader of one shard records all of it or none."""
    if shards is None or rec["reason"] not in RECORDED_ONCE:
        return True
    shard, at, entry = rec["id"].rpartition("@")
    kafka = "-" not in entry  # an offset, not a stream entry's `<ms>-<seq>`
    return bool(at) and (shard in shards or (kafka and ALL_SHARDS in shards))


def write_dead_letters(client: Any, ctx: WriterContext, dead: list[str]) -> dict[str, int]:
    dead.sort()
    digest = hashlib.blake2b("\n".join(dead).encode(), digest_size=12).hexdigest()
    reasons: dict[str, int] = {}
    args: list[str] = []
    for k in dead:
        rec = orjson.loads(k)
        reasons[rec["reason"]] = reasons.get(rec["reason"], 0) + 1
        if not records(ctx.recorded_shards, rec):
            continue
        args += [
            rec["id"],
            str(rec.get("idx") or 0),
            rec["reason"],
            rec.get("field") or "",
            rec.get("raw") or "",
            "" if rec.get("ts") is None else str(rec["ts"]),
            str(ctx.token),
        ]
    if not args:
        return reasons
    script = client.register_script(script_source(DEAD_LETTERS))
    marker = dead_letter_marker_key(ctx.source_stream, ctx.token, digest)
    script(
        keys=[marker, dead_letter_stream_key(ctx.source_stream)],
        args=[DEAD_MARKER_TTL_S, ctx.dead_letter_maxlen, *args],
    )
    return reasons


def summarize(
    rows: list[Any], batch_id: int, token: int, started_ms: int, done_ms: int
) -> dict[str, Any]:
    """Fold the writer's per-partition counters into one batch record."""
    rec: dict[str, Any] = {
        "batch": batch_id,
        "token": token,
        "events": 0,
        "dead": 0,
        "updates_applied": 0,
        "updates_duplicate": 0,
        "updates_expired": 0,
        "updates_before_seam": 0,
        "min_ems": None,
        "max_ems": None,
        "started_ms": started_ms,
        "done_ms": done_ms,
        "write_ms": None,
        "write_updates": 0,
        "fold_rows": 0,
        "fold_cells": 0,
        "dead_by_reason": {},
    }
    for r in rows:
        if r["kind"] == "stats":
            rec["events"] += r["events"]
            rec["fold_rows"] += r.get("fold_rows") or 0
            rec["fold_cells"] += r.get("fold_cells") or 0
            w = r.get("write_ms")
            if w is not None and w >= (rec["write_ms"] or 0.0):
                rec["write_ms"] = round(w, 1)  # the slowest partition's, and its updates
                rec["write_updates"] = sum(r.get(k) or 0 for k in UPDATE_COUNTS)
            for key, pick in (("min_ems", min), ("max_ems", max)):
                v = r[key]
                if v is not None:
                    rec[key] = v if rec[key] is None else pick(rec[key], v)
            for name in UPDATE_COUNTS:
                rec[name] += r.get(name) or 0
        elif r["kind"] == "dead":
            rec["dead"] += r["events"]
            rec["events"] += r["events"]
            by = rec["dead_by_reason"]
            by[r["reason"]] = by.get(r["reason"], 0) + r["events"]
    return rec
