"""The per-batch XOR completeness audit: seed 003's acker, adapted to micro-batches.

Every source event has a 64-bit id derived from its stream, its entry id and its index in the
entry (`source.ids.event_ids`). Three XORs are taken per batch:

- **source**: the ids of the events the batch admitted, read from the log itself over the
  batch's spans (taken from Spark's offset log; `source.log.Log.admitted`: a Lua script over a
  Redis stream, a second read of a Kafka partition), independently of the Spark plan;
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

import orjson

from sluice.redis.keys import STATS_KEY

LEDGER_KEEP = 1024  # records kept per ledger shard


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


def batch_offsets(ckpt: Path, batch_id: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(start, end) offsets of a batch, as the source logged them in Spark's offset log
    (written before the batch ran); the start of batch 0 is {}."""
    end = _logged(ckpt / "offsets" / str(batch_id))
    if end is None:
        raise FileNotFoundError(f"no offset log entry for batch {batch_id} under {ckpt}")
    start = _logged(ckpt / "offsets" / str(batch_id - 1)) if batch_id > 0 else None
    return (start or {}), end


def _logged(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    # v1 / batch metadata / one line per source: ours is the only source.
    offsets: dict[str, Any] = json.loads(lines[2])
    return offsets


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
