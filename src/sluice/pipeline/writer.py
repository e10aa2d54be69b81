"""Executor-side store writer: slice updates -> Redis, idempotent per batch.

Runs inside `mapInArrow` on the executors, so the writes go straight from the tasks to Redis and
only a few counters come back to the driver.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa

from sluice.pipeline.plan import DEAD_G, MetricSpec
from sluice.redis.connection import client_for
from sluice.redis.keys import (
    dead_letter_marker_key,
    dead_letter_stream_key,
    key_slot,
    slice_hash_key,
    slice_hll_key,
)
from sluice.redis.scripts import DEAD_LETTERS, WRITE_SLICES, evalsha_on, script_source
from sluice.slices.aggs import AGGS, HLL

PIPELINE_CHUNK = 50
KEYS_PER_CALL = 100
DEAD_MARKER_TTL_S = 7 * 86400
MASK64 = (1 << 64) - 1

RESULT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("m", pa.int32()),
        ("updates_applied", pa.int64()),
        ("updates_duplicate", pa.int64()),
        ("updates_expired", pa.int64()),
        ("events", pa.int64()),
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
    " events long,"
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


@dataclass
class PartitionUpdates:
    """Everything one writer partition has to apply, gathered from its Arrow batches."""

    lua: dict[tuple[int, str], list[str]] = field(default_factory=dict)  # -> [s, v.., s, v..]
    hll: dict[tuple[int, str, int], list[str]] = field(default_factory=dict)  # -> values
    blob: dict[tuple[int, str], list[tuple[int, bytes]]] = field(default_factory=dict)
    good: int = 0
    min_ems: int | None = None
    max_ems: int | None = None
    dead: list[str] = field(default_factory=list)
    # The audit's view (see pipeline.audit): XOR of the rows' fan-out ids, and per row the XOR
    # of its update ids with the writes it depends on; a row is applied when all of them are.
    audited: bool = False
    fan_x: int = 0
    rows: list[tuple[int, list[tuple[Any, ...]]]] = field(default_factory=list)

    def add_batch(self, batch: pa.RecordBatch, by_group: dict[int, list[MetricSpec]]) -> None:
        cols = {name: batch.column(name).to_pylist() for name in batch.schema.names}
        gs, ks, ss = cols["g"], cols["k"], cols["s"]
        self.audited = "ux" in cols
        deps: list[list[tuple[Any, ...]]] = [[] for _ in gs]
        lo = [v for v in cols["min_ems"] if v is not None]
        hi = [v for v in cols["max_ems"] if v is not None]
        if lo:
            self.min_ems = min(lo) if self.min_ems is None else min(self.min_ems, *lo)
            self.max_ems = max(hi) if self.max_ems is None else max(self.max_ems, *hi)
        for row, g in enumerate(gs):
            if g == DEAD_G:
                self.dead.append(ks[row])
                deps[row].append(("d",))
            elif g == 0:
                self.good += cols["cnt"][row]
        for g, members in by_group.items():
            rows = [r for r, grp in enumerate(gs) if grp == g and ks[r] is not None]
            for sp in members:
                n = cols[f"n{sp.index}"]
                agg = AGGS[sp.agg]
                encode = agg.encode if agg.lua else None
                # The folded columns, in the order `agg.encode` takes them (see plan.fold_columns).
                folded = [cols[f"{f.column}{sp.index}"] for f in agg.folds]
                for row in rows:
                    if not n[row]:
                        continue
                    k, s = ks[row], ss[row]
                    if encode is not None:
                        state = encode(n[row], *(col[row] for col in folded))
                        self.lua.setdefault((sp.index, k), []).extend((str(s), *state))
                        deps[row].append(("l", sp.index, k))
                    elif agg.state == HLL:
                        self.hll[(sp.index, k, s)] = folded[0][row]
                        deps[row].append(("h", sp.index, k, s))
                    else:  # BLOB
                        self.blob.setdefault((sp.index, k), []).append((s, folded[0][row]))
                        deps[row].append(("l", sp.index, k))
        if self.audited:
            for row, (ux, fx) in enumerate(zip(cols["ux"], cols["fx"], strict=True)):
                self.fan_x ^= fx & MASK64
                self.rows.append((ux & MASK64, deps[row]))

    def applied_x(self, failed: set[tuple[Any, ...]]) -> int:
        """XOR of the update ids of the rows whose every write was acknowledged."""
        out = 0
        for ux, deps in self.rows:
            if not failed or not any(d in failed for d in deps):
                out ^= ux
        return out


def write_partition(
    ctx: WriterContext, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: apply every slice update of this partition, yield counters."""
    by_group: dict[int, list[MetricSpec]] = {}
    for sp in ctx.specs:
        by_group.setdefault(sp.group, []).append(sp)
    updates = PartitionUpdates()
    for batch in batches:
        updates.add_batch(batch, by_group)
    client = client_for(ctx.url, timeout_s=60, connect_timeout_s=10)
    t0 = time.perf_counter()
    failed: set[tuple[Any, ...]] = set()
    try:
        totals = _apply_lua(client, ctx, updates, failed)
        totals[0] += _apply_hll(client, ctx, updates.hll)
        blob = _apply_blob(client, ctx, updates.blob, failed)
        totals = [a + b for a, b in zip(totals, blob, strict=True)]
        reasons = write_dead_letters(client, ctx, updates.dead) if updates.dead else {}
    finally:
        client.close()
    write_ms = (time.perf_counter() - t0) * 1000
    out: list[dict[str, Any]] = [
        {
            "kind": "stats",
            "write_ms": write_ms,
            "events": updates.good,
            "min_ems": updates.min_ems,
            "max_ems": updates.max_ems,
            "updates_applied": totals[0],
            "updates_duplicate": totals[1],
            "updates_expired": totals[2],
            "fan_x": _signed(updates.fan_x) if updates.audited else None,
            "applied_x": _signed(updates.applied_x(failed)) if updates.audited else None,
        }
    ]
    out += [{"kind": "dead", "reason": r, "events": n} for r, n in reasons.items()]
    yield pa.RecordBatch.from_pylist(out, schema=RESULT_SCHEMA)


def _signed(x: int) -> int:
    """An unsigned 64-bit id as Spark's signed long (same bits)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def run_write_script(
    client: Any,
    ctx: WriterContext,
    calls: list[tuple[str, list[Any], tuple[Any, ...]]],
    failed: set[tuple[Any, ...]],
) -> list[int]:
    """Run write_slices.lua over (key, args, dep) triples: KEYS_PER_CALL keys a call, pipelined.

    Each call's reply counts the slices it applied, skipped as duplicates and dropped as expired;
    a call whose counts do not add up to the slices sent (or that was never sent) puts the deps
    of its keys in `failed`, so the audit sees those updates as not applied.
    On Redis Cluster the keys of one call must share a slot, so they are grouped by slot.
    """
    client.script_load(script_source(WRITE_SLICES))  # once per partition; then EVALSHA only
    by_slot: dict[int, list[tuple[str, list[Any], tuple[Any, ...]]]] = {}
    for item in calls:
        by_slot.setdefault(key_slot(item[0]) if ctx.cluster else 0, []).append(item)
    totals = [0, 0, 0]
    pipe = client.pipeline(transaction=False)
    queued: list[tuple[int, list[tuple[Any, ...]]]] = []  # (slices sent, deps) per call

    def drain() -> None:
        for res, (expected, deps) in zip(pipe.execute(), queued, strict=True):
            for j in range(3):
                totals[j] += int(res[j])
            if sum(int(x) for x in res[:3]) != expected:
                failed.update(deps)
        queued.clear()

    for items in by_slot.values():
        for j in range(0, len(items), KEYS_PER_CALL):
            chunk = items[j : j + KEYS_PER_CALL]
            deps = [dep for _, _, dep in chunk]
            flat: list[Any] = [str(ctx.token)]
            keys: list[str] = []
            expected = 0
            for key, args, _ in chunk:
                expected += int(args[3])
                keys.append(key)
                flat.extend(args)
            evalsha_on(pipe, WRITE_SLICES, keys, flat)
            queued.append((expected, deps))
            if len(queued) >= PIPELINE_CHUNK:
                drain()
    if queued:
        drain()
    return totals


def _slice_call(sp: MetricSpec, k: str, flat: list[Any]) -> tuple[str, list[Any], tuple[Any, ...]]:
    """write_slices.lua's (key, args, dep) for one (metric, key): `flat` is (start, state...)
    per slice, the state being the agg's `width` values."""
    agg = AGGS[sp.agg]
    n = len(flat) // (agg.width + 1)
    head = [agg.state, str(sp.slice_ms), str(sp.retention_ms), str(n), str(agg.width)]
    return slice_hash_key(sp.name, k, sp.resolution_ms), [*head, *flat], ("l", sp.index, k)


def _apply_lua(
    client: Any, ctx: WriterContext, updates: PartitionUpdates, failed: set[tuple[Any, ...]]
) -> list[int]:
    specs = {sp.index: sp for sp in ctx.specs}
    calls = [_slice_call(specs[i], k, flat) for (i, k), flat in updates.lua.items()]
    return run_write_script(client, ctx, calls, failed)


def _apply_hll(client: Any, ctx: WriterContext, hll: dict[tuple[int, str, int], list[str]]) -> int:
    """distinct: PFADD each slice's values into its HyperLogLog. PFADD is idempotent, so a re-run
    batch adds nothing twice and needs no token."""
    specs = {sp.index: sp for sp in ctx.specs}
    pipe = client.pipeline(transaction=False)
    for n, ((i, k, s), values) in enumerate(hll.items(), start=1):
        sp = specs[i]
        key = slice_hll_key(sp.name, k, s, sp.resolution_ms)
        for j in range(0, len(values), 10_000):
            pipe.pfadd(key, *values[j : j + 10_000])
        pipe.pexpireat(key, s + sp.slice_ms + sp.retention_ms)
        if n % PIPELINE_CHUNK == 0:
            pipe.execute()
    pipe.execute()
    return len(hll)


def _apply_blob(
    client: Any,
    ctx: WriterContext,
    blob: dict[tuple[int, str], list[tuple[int, bytes]]],
    failed: set[tuple[Any, ...]],
) -> list[int]:
    """Blob states (quantile's sketches): merge each slice's blob into the stored one with the
    agg's `union`, then write it back guarded by the writer token (a slice already holding this
    batch's token is left alone)."""
    if not blob:
        return [0, 0, 0]
    specs = {sp.index: sp for sp in ctx.specs}
    items = list(blob.items())
    pipe = client.pipeline(transaction=False)
    for (i, k), cells in items:
        pipe.hmget(
            slice_hash_key(specs[i].name, k, specs[i].resolution_ms), [str(s) for s, _ in cells]
        )
    stored = pipe.execute()
    calls = []
    dups = 0
    for ((i, k), cells), olds in zip(items, stored, strict=True):
        union = AGGS[specs[i].agg].union
        if union is None:
            raise ValueError(f"agg {specs[i].agg!r} has no blob union")
        flat: list[Any] = []
        for (s, value), old in zip(cells, olds, strict=True):
            value = bytes(value)
            if old is not None:
                token, _, old_value = old.partition(b":")
                if int(token) >= ctx.token:
                    dups += 1
                    continue
                value = union([old_value, value]) or value  # never None: two blobs in
            flat += [str(s), value]
        if flat:
            calls.append(_slice_call(specs[i], k, flat))
    totals = run_write_script(client, ctx, calls, failed)
    totals[1] += dups
    return totals


def write_dead_letters(client: Any, ctx: WriterContext, dead: list[str]) -> dict[str, int]:
    dead.sort()
    digest = hashlib.blake2b("\n".join(dead).encode(), digest_size=12).hexdigest()
    reasons: dict[str, int] = {}
    args: list[str] = []
    for k in dead:
        rec = orjson.loads(k)
        reasons[rec["reason"]] = reasons.get(rec["reason"], 0) + 1
        args += [
            rec["id"],
            str(rec.get("idx") or 0),
            rec["reason"],
            rec.get("field") or "",
            rec.get("raw") or "",
            "" if rec.get("ts") is None else str(rec["ts"]),
            str(ctx.token),
        ]
    script = client.register_script(script_source(DEAD_LETTERS))
    marker = dead_letter_marker_key(ctx.source_stream, ctx.token, digest)
    script(
        keys=[marker, dead_letter_stream_key(ctx.source_stream)],
        args=[DEAD_MARKER_TTL_S, ctx.dead_letter_maxlen, *args],
    )
    return reasons
