"""Where each micro-batch's time goes, published per batch for the status views.

Spark's phases come from the query's progress (`durationMs`): `latestOffset` (the source plans
the batch: admission and the log's end positions), `queryPlanning`, `walCommit` (the offset
log), `addBatch` (the whole foreachBatch call) and `commitOffsets` (the commit log). Sluice's
steps inside `addBatch` are measured by the batch itself (`BatchTimings.add`):

- `analyze`: the driver building the batch's fold (each DataFrame step is analysed by Spark);
- `decode`: the longest read-and-decode of one input partition, reported by the executors
  (`sluice:{stats[:<stage>]}:decode`, see `source.reader`);
- `write`: the longest store write of one writer partition;
- `fold`: the rest of the Spark job (explode, shuffle, aggregate, scheduling, Python workers);
- `audit`: how long the batch waited for its audit's source side once the job was done (the
  audit runs beside the job);
- `record`: the batch record, the ledger and the store monitor;
- `lease`: the lease check before the commit;
- `wait` (write-behind, `pipeline.behind`): how long the batch, folded, waited for the previous
  batch's write to finish before starting its own.

Under write-behind a batch's `write`, `audit` and `record` run beside the next batch, outside
its `addBatch`: they go to the entry's `behind` (`{write, audit, record}`), not to its phases,
and the entry is published once they are done (`hold` / `done`).

Whatever `addBatch` and the whole trigger spent beyond the named phases is `other`. Partitions
run in parallel, so `decode` and `write` are the longest partition, not a sum, and `fold` is
what is left of the job's wall time.

An entry goes to `sluice:{stats[:<stage>]}:timings` (newest first, TIMINGS_KEEP kept) once Spark
reported the batch's progress, after it committed: the next batch publishes it from the query's
`lastProgress` (`publish_last`), so the newest batch shows one batch late. No listener on Spark's
listener bus: one would call back into the JVM while it shuts down (a signal to the process
group) and log py4j's errors. Entries: `{batch, events, total_ms, done_ms, phases}`.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Any

import orjson

from sluice.redis.keys import decode_times_key, timings_key
from sluice.status.timings import SLUICE_PHASES, SPARK_PHASES

log = logging.getLogger(__name__)

TIMINGS_KEEP = 600
PENDING_KEEP = 64  # batches measured whose progress has not come yet
BEHIND = ("write", "audit", "record")  # a batch written behind: beside the next batch


class BatchTimings:
    """One streaming query's measurements, per batch, until Spark reports its progress."""

    def __init__(self, client: Any, stage: str) -> None:
        self.client = client
        self.stage = stage
        self.key = timings_key(stage)
        self.decode_key = decode_times_key(stage)
        self._pending: dict[int, dict[str, float]] = {}
        self._published = -1
        self._held: set[int] = set()  # written behind, not yet done
        self._waiting: dict[int, dict[str, Any]] = {}  # their progress, come meanwhile
        self._lock = threading.Lock()

    def hold(self, batch: int) -> None:
        """Batch `batch` is written behind: publish it only once `done(batch)`."""
        with self._lock:
            self._held.add(batch)
            while len(self._held) > PENDING_KEEP:  # writes that failed are never done
                self._held.discard(min(self._held))
            self._pending.setdefault(batch, {})["behind"] = 1.0

    def done(self, batch: int) -> None:
        """A batch written behind is done: publish it if Spark reported it meanwhile."""
        with self._lock:
            self._held.discard(batch)
            progress = self._waiting.pop(batch, None)
            own = self._pending.pop(batch, {}) if progress is not None else None
        if progress is not None and own is not None:
            self._push(progress, own)

    def add(self, batch: int, **ms: float | None) -> None:
        """Add measured milliseconds to batch `batch`'s own phases (None is left out)."""
        with self._lock:
            cur = self._pending.setdefault(batch, {})
            for k, v in ms.items():
                if v is not None:
                    cur[k] = cur.get(k, 0.0) + float(v)
            while len(self._pending) > PENDING_KEEP:
                del self._pending[min(self._pending)]

    def take(self, batch: int, name: str) -> float | None:
        """Remove and return a measurement that is not a phase itself (e.g. the whole job)."""
        with self._lock:
            return self._pending.get(batch, {}).pop(name, None)

    def decode_ms(self, ref_ms: int | None) -> float | None:
        """The longest read-and-decode of one partition of the batch planned at `ref_ms`, as
        the executors reported it; taken out of Redis. None when none was reported."""
        if ref_ms is None:
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.zscore(self.decode_key, str(ref_ms))
            pipe.zrem(self.decode_key, str(ref_ms))
            ms, _ = pipe.execute()
        except Exception as e:  # noqa: BLE001 - a measurement only
            log.debug("decode time not read", extra={"error": str(e)})
            return None
        return None if ms is None else float(ms)

    def publish_last(self, query: Any) -> None:
        """Publish the newest batch Spark reported for streaming query `query` (its
        `lastProgress`). Called from the query's next batch; never raises."""
        try:
            last = query.lastProgress
            progress = orjson.loads(last.json) if last else None
        except Exception as e:  # noqa: BLE001 - a measurement only
            log.debug("progress not read", extra={"error": str(e)})
            return
        self.publish(progress)

    def publish(self, progress: dict[str, Any] | None) -> None:
        """Spark reported batch `progress["batchId"]` (a query's `lastProgress`, or None):
        publish its entry, once. Never raises."""
        if not progress:
            return
        batch = int(progress.get("batchId", -1))
        with self._lock:
            if batch <= self._published:
                return
            self._published = batch
            if batch in self._held:
                self._waiting[batch] = progress
                while len(self._waiting) > PENDING_KEEP:
                    del self._waiting[min(self._waiting)]
                return
            own = self._pending.pop(batch, {})
        self._push(progress, own)

    def _push(self, progress: dict[str, Any], own: dict[str, float]) -> None:
        entry = breakdown(progress, own)
        if entry is None:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(self.key, orjson.dumps(entry))
            pipe.ltrim(self.key, 0, TIMINGS_KEEP - 1)
            pipe.execute()
        except Exception as e:  # noqa: BLE001 - display only
            log.debug("batch timing not published", extra={"error": str(e)})


def breakdown(progress: dict[str, Any], own: dict[str, float]) -> dict[str, Any] | None:
    """A batch's entry from Spark's progress and its own measurements; None for a trigger
    that ran no batch (no input)."""
    rows = int(progress.get("numInputRows") or 0)
    d = progress.get("durationMs") or {}
    if not rows or "addBatch" not in d:
        return None
    phases: dict[str, float] = {k: float(d.get(k, 0)) for k in SPARK_PHASES}
    own = dict(own)
    behind = {k: round(own.pop(k, 0.0), 1) for k in BEHIND} if own.pop("behind", 0.0) else None
    named = sum(own.get(k, 0.0) for k in SLUICE_PHASES)
    phases.update({k: round(own.get(k, 0.0), 1) for k in SLUICE_PHASES})
    total = float(d.get("triggerExecution", 0))
    spark = sum(phases[k] for k in SPARK_PHASES) + float(d["addBatch"])
    # addBatch beyond Sluice's own steps (the foreachBatch call, building the batch's frame),
    # and the trigger beyond Spark's phases.
    phases["other"] = round(max(0.0, float(d["addBatch"]) - named) + max(0.0, total - spark), 1)
    entry = {"batch": int(progress.get("batchId", -1)), "events": rows, "total_ms": total,
             "done_ms": _done_ms(progress), "phases": phases}  # fmt: skip
    if behind is not None:
        entry["behind"] = behind
    return entry


def _done_ms(progress: dict[str, Any]) -> int | None:
    """The batch's end, epoch ms: its trigger's start (`timestamp`) plus its duration."""
    stamp = progress.get("timestamp")
    if not stamp:
        return None
    start = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    total = float((progress.get("durationMs") or {}).get("triggerExecution", 0))
    return int(start.timestamp() * 1000 + total)
