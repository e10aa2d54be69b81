"""The per-batch XOR completeness audit: seed 003's acker, adapted to micro-batches.

Every source event has a 64-bit id derived from its stream, its entry id and its index in the
entry (`source.ids.event_ids`). Three XORs are taken per batch:

- **source**: the ids of the events the batch admitted, read from Redis by this module with a
  Lua script over the batch's offset range (taken from Spark's offset log), independently of
  the Spark plan;
- **fan-out**: per event, its id XOR the ids of the updates it fans out into (one per metric
  group it touches, or its dead-letter record); computed in the plan before anything is written
  (`pipeline.plan._audit_columns`);
- **applied**: the ids of the updates the store acknowledged (`pipeline.writer`: a write call
  whose reply does not account for every slice it carried counts as not applied).

source ⊕ fan-out ⊕ applied is 0 exactly when every admitted event was decoded once, every
update it produced was written, and nothing else was (up to a 2^-64 chance of a false zero). A
batch that does not balance is written again in place (the writes are idempotent per token), and
after `audit.retries` replays the batch fails, so it is neither committed nor trimmed, and the
restarted query replays it from the offset log.

The ledger keeps one small record per batch, whatever its size: it is spread over
`audit.ledger_shards` hashes `sluice:audit:{<stream>#<n>}`, n = batch mod shards. On Redis
Cluster each hash tag lands on its own slot, so the 16384 slots play the part of seed 003's
virtual nodes: resharding moves whole slots, and so only the ledger shards on them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from sluice.redis.keys import STATS_KEY
from sluice.redis.scripts import AUDIT_SOURCE, script_source
from sluice.source.ids import ZERO_ID, event_ids, parse_id, xor_all

LEDGER_KEEP = 1024  # records kept per ledger shard
# Entries per Lua call: a jsonl entry holds hundreds of events and tens of KB, so fewer of them
# keep each call short (Redis serves no one else meanwhile) and its memory small.
SOURCE_CHUNK = {"fields": 5000, "jsonl": 20}


@dataclass(frozen=True)
class AuditResult:
    batch: int
    attempt: int
    source_x: int
    fan_x: int
    applied_x: int
    events: int  # admitted, as counted from the stream
    entries: int
    audit_ms: float

    @property
    def residual(self) -> int:
        return self.source_x ^ self.fan_x ^ self.applied_x

    @property
    def ok(self) -> bool:
        return self.residual == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "residual": self.residual, "ok": self.ok}


def batch_offsets(ckpt: Path, batch_id: int) -> tuple[dict[str, str], dict[str, str]]:
    """(start ids, end ids) of a batch, from Spark's offset log (written before it ran)."""
    end = _logged_ids(ckpt / "offsets" / str(batch_id))
    if end is None:
        raise FileNotFoundError(f"no offset log entry for batch {batch_id} under {ckpt}")
    start = _logged_ids(ckpt / "offsets" / str(batch_id - 1)) if batch_id > 0 else None
    return (start or dict.fromkeys(end, ZERO_ID)), end


def _logged_ids(path: Path) -> dict[str, str] | None:
    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    # v1 / batch metadata / one line per source: ours is the only source.
    ids: dict[str, str] = json.loads(lines[2])["ids"]
    return ids


def source_xor(
    client: Any,
    start: dict[str, str],
    end: dict[str, str],
    fmt: str,
    max_entry_bytes: int,
) -> tuple[int, int, int]:
    """XOR of the ids of the events in (start, end], shard by shard: (xor, events, entries)."""
    script = client.register_script(script_source(AUDIT_SOURCE))
    acc, events, entries = 0, 0, 0
    for shard, hi in end.items():
        lo = start.get(shard, ZERO_ID)
        if parse_id(hi) <= parse_id(lo):
            continue
        cursor = lo
        while True:
            reply = script(keys=[shard], args=[cursor, hi, fmt, max_entry_bytes, SOURCE_CHUNK[fmt]])
            pairs = reply[1:]
            if pairs:
                ids = [parse_id(x) for x in (pairs[0::2] if fmt == "jsonl" else pairs)]
                counts = (
                    np.asarray(pairs[1::2], dtype=np.int64)
                    if fmt == "jsonl"
                    else np.ones(len(ids), dtype=np.int64)
                )
                parts = np.asarray(ids, dtype=np.uint64).reshape(-1, 2)
                n = int(counts.sum())
                starts = np.cumsum(counts) - counts
                idx = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
                acc ^= xor_all(
                    event_ids(
                        np.repeat(parts[:, 0], counts).astype(np.int64),
                        np.repeat(parts[:, 1], counts),
                        idx,
                        shard,
                    )
                )
                events += n
                entries += len(ids)
            nxt = reply[0]
            if not nxt:
                break
            cursor = nxt.decode() if isinstance(nxt, bytes) else str(nxt)
    return acc, events, entries


def writer_xors(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(fan-out, applied) XORs from the writer partitions' stats rows."""
    fan = applied = 0
    for r in rows:
        if r["kind"] == "stats" and r.get("fan_x") is not None:
            fan ^= int(r["fan_x"]) & ((1 << 64) - 1)
            applied ^= int(r["applied_x"]) & ((1 << 64) - 1)
    return fan, applied


class Ledger:
    def __init__(self, client: Any, stream: str, shards: int) -> None:
        self.client = client
        self.stream = stream
        self.shards = shards

    def key(self, batch_id: int) -> str:
        return f"sluice:audit:{{{self.stream}#{batch_id % self.shards}}}"

    def record(self, result: AuditResult) -> None:
        pipe = self.client.pipeline(transaction=False)
        key = self.key(result.batch)
        pipe.hset(key, str(result.batch), orjson.dumps(result.as_dict()))
        old = result.batch - self.shards * LEDGER_KEEP
        if old >= 0:
            pipe.hdel(self.key(old), str(old))
        if not result.ok:
            # Every failed attempt counts. A balanced batch is counted as `audit_ok` with the
            # batch's other counters, once per writer token, so a batch replayed after a crash
            # (audited again) is not counted twice.
            pipe.hincrby(STATS_KEY, "audit_failed", 1)
            pipe.lpush(self.failures_key, orjson.dumps(result.as_dict()))
            pipe.ltrim(self.failures_key, 0, 999)
        pipe.execute()

    @property
    def failures_key(self) -> str:
        return f"sluice:audit:{{{self.stream}#failures}}"

    def failures(self, n: int = 20) -> list[dict[str, Any]]:
        """The newest failed attempts (a later attempt of the same batch may have passed)."""
        return [orjson.loads(r) for r in self.client.lrange(self.failures_key, 0, n - 1)]

    def get(self, batch_id: int) -> dict[str, Any] | None:
        raw = self.client.hget(self.key(batch_id), str(batch_id))
        return orjson.loads(raw) if raw else None

    def recent(self, last_batch: int, n: int = 20) -> list[dict[str, Any]]:
        """The records of batches last_batch-n+1 .. last_batch, newest first."""
        ids = [b for b in range(last_batch, max(-1, last_batch - n), -1)]
        pipe = self.client.pipeline(transaction=False)
        for b in ids:
            pipe.hget(self.key(b), str(b))
        return [orjson.loads(r) for r in pipe.execute() if r]
