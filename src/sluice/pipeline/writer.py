"""Executor-side store writer: slice updates -> Redis, idempotent per batch.

Runs inside `mapInArrow` on the executors, so the writes go straight from the tasks to Redis and
only a few counters come back to the driver.

Idempotency. Every write carries a *token* = epoch * 10**12 + batch_id. `epoch` is a counter
taken once per fresh checkpoint (see `job.writer_epoch`), so tokens only grow across the life of a
deployment. The slice-write script stores the token beside each slice's state and skips an update
whose token is not newer than the stored one, atomically with the merge. A batch that Spark
re-runs after a crash has the same batch id and offsets, hence the same updates and token: slices
that the failed attempt already wrote are skipped, the rest are applied. Dead letters are guarded
the same way, by a marker per (token, content digest) set in the same script as the XADDs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from sluice.pipeline.plan import DEAD_G, MetricSpec
from sluice.redis.keys import dead_letter_marker_key, dead_letter_stream_key, slice_hash_key

TOKEN_EPOCH = 10**12
PIPELINE_CHUNK = 50
KEYS_PER_CALL = 100
DEAD_MARKER_TTL_S = 7 * 86400

RESULT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("m", pa.int32()),
        ("applied", pa.int64()),
        ("dups", pa.int64()),
        ("expired", pa.int64()),
        ("events", pa.int64()),
        ("min_ems", pa.int64()),
        ("max_ems", pa.int64()),
        ("reason", pa.string()),
    ]
)
RESULT_DDL = (
    "kind string, m int, applied long, dups long, expired long, events long,"
    " min_ems long, max_ems long, reason string"
)


def writer_token(epoch: int, batch_id: int) -> int:
    return epoch * TOKEN_EPOCH + batch_id


@dataclass(frozen=True)
class WriterContext:
    url: str
    token: int
    specs: tuple[MetricSpec, ...]
    source_stream: str
    dead_letter_maxlen: int
    cluster: bool = False
    fault_drop_every: int = 0  # test hook: drop every n-th script call (0 = never)


def _num(x: Any) -> str:
    """Shortest exact text for a number; Lua's tonumber reads it back to the same double."""
    return repr(x) if isinstance(x, float) else str(x)


def _state_columns(spec: MetricSpec, cols: dict[str, list[Any]]) -> tuple[list[Any], list[Any]]:
    """The (a, b) columns of the packed state (see write_slices.lua) for one metric."""
    i = spec.index
    n = cols[f"n{i}"]
    if spec.agg == "count":
        return n, n
    if spec.agg == "avg":
        return n, cols[f"sum{i}"]
    a = cols[f"{spec.agg}{i}"]
    return a, a


def write_partition(
    ctx: WriterContext, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: apply every slice update of this partition, yield counters.

    Updates of many keys go in one script call (KEYS_PER_CALL), calls are pipelined; on Redis
    Cluster the keys of one call must share a slot, so they are grouped by slot first.
    """
    import redis

    from sluice.redis.keys import key_slot
    from sluice.redis.scripts import WRITE_SLICES, script_source

    client = redis.Redis.from_url(ctx.url, socket_timeout=60, socket_connect_timeout=10)
    script = client.register_script(script_source(WRITE_SLICES))
    by_group: dict[int, list[MetricSpec]] = {}
    for sp in ctx.specs:
        by_group.setdefault(sp.group, []).append(sp)
    # (metric index, key) -> flat [s, a, b, s, a, b, ...]
    updates: dict[tuple[int, str], list[str]] = {}
    good = 0
    min_ems: int | None = None
    max_ems: int | None = None
    dead: list[str] = []
    for batch in batches:
        cols = {name: batch.column(name).to_pylist() for name in batch.schema.names}
        gs, ks, ss = cols["g"], cols["k"], cols["s"]
        lo = [v for v in cols["min_ems"] if v is not None]
        hi = [v for v in cols["max_ems"] if v is not None]
        if lo:
            min_ems = min(lo) if min_ems is None else min(min_ems, *lo)
            max_ems = max(hi) if max_ems is None else max(max_ems, *hi)
        for row, g in enumerate(gs):
            if g == DEAD_G:
                dead.append(ks[row])
            elif g == 0:
                good += cols["cnt"][row]
        for g, members in by_group.items():
            for sp in members:
                n = cols[f"n{sp.index}"]
                a_col, b_col = _state_columns(sp, cols)
                avg = sp.agg == "avg"
                for row, grp in enumerate(gs):
                    if grp != g or not n[row] or ks[row] is None:
                        continue
                    b = _num(b_col[row]) if avg else "0"
                    updates.setdefault((sp.index, ks[row]), []).extend(
                        (str(ss[row]), _num(a_col[row]), b)
                    )
    specs = {sp.index: sp for sp in ctx.specs}
    cluster = ctx.cluster
    calls: dict[int, list[tuple[str, list[str]]]] = {}
    for (i, k), triples in updates.items():
        sp = specs[i]
        key = slice_hash_key(sp.name, k)
        args = [sp.agg, str(sp.slice_ms), str(sp.retention_ms), str(len(triples) // 3), *triples]
        calls.setdefault(key_slot(key) if cluster else 0, []).append((key, args))
    totals = [0, 0, 0]
    pipe = client.pipeline(transaction=False)
    queued = 0
    n_calls = 0
    for items in calls.values():
        for j in range(0, len(items), KEYS_PER_CALL):
            chunk = items[j : j + KEYS_PER_CALL]
            n_calls += 1
            if ctx.fault_drop_every and n_calls % ctx.fault_drop_every == 0:
                continue
            flat: list[str] = [str(ctx.token)]
            for _, args in chunk:
                flat.extend(args)
            script(keys=[key for key, _ in chunk], args=flat, client=pipe)
            queued += 1
            if queued >= PIPELINE_CHUNK:
                for res in pipe.execute():
                    for j2 in range(3):
                        totals[j2] += int(res[j2])
                queued = 0
    if queued:
        for res in pipe.execute():
            for j2 in range(3):
                totals[j2] += int(res[j2])
    reasons = _write_dead_letters(client, ctx, dead) if dead else {}
    client.close()
    out: list[dict[str, Any]] = [
        {
            "kind": "stats",
            "events": good,
            "min_ems": min_ems,
            "max_ems": max_ems,
            "applied": totals[0],
            "dups": totals[1],
            "expired": totals[2],
        }
    ]
    out += [{"kind": "dead", "reason": r, "events": n} for r, n in reasons.items()]
    yield pa.RecordBatch.from_pylist(out, schema=RESULT_SCHEMA)


def _write_dead_letters(client: Any, ctx: WriterContext, dead: list[str]) -> dict[str, int]:
    import orjson

    from sluice.redis.scripts import DEAD_LETTERS, script_source

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
