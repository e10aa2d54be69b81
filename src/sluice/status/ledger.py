"""The audit's ledger: one small record per batch attempt, whatever the batch's size.

Written by the fold after each attempt (`pipeline.audit` computes the result), read by the
status views. It is spread over `audit.ledger_shards` hashes `sluice:audit:{<stream>#<n>}`,
n = batch mod shards. On Redis Cluster each hash tag lands on its own slot, so the 16384 slots
play the part of seed 003's virtual nodes: resharding moves whole slots, and so only the ledger
shards on them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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
    removed: int = 0  # admitted by the plan, gone from the log when read again

    @property
    def residual(self) -> int:
        return self.source_x ^ self.fan_x ^ self.applied_x

    @property
    def ok(self) -> bool:
        return self.residual == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "residual": self.residual, "ok": self.ok}

    def sides(self) -> dict[str, Any]:
        """The three XORs in hex and the events admitted, for a log record of an imbalance."""
        return {"residual": f"{self.residual:#018x}", "source_x": f"{self.source_x:#018x}",
                "fan_x": f"{self.fan_x:#018x}", "applied_x": f"{self.applied_x:#018x}",
                "events_admitted": self.events}  # fmt: skip


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
