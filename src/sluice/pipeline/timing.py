"""Where each micro-batch's time goes, published per batch for the status views.

Spark's phases come from the query's progress (`durationMs`): `latestOffset` (the source plans
the batch: admission and the log's end positions), `queryPlanning`, `walCommit` (the offset
log), `addBatch` (the whole foreachBatch call) and `commitOffsets` (the commit log). Sluice's
steps inside `addBatch` are measured by the batch itself (`BatchTimings.add`):

- `decode`: the longest read-and-decode of one input partition, reported by the executors
  (`sluice:{stats[:<stage>]}:decode`, see `source.reader`);
- `write`: the longest store write of one writer partition;
- `fold`: the rest of the Spark job (explode, shuffle, aggregate, scheduling, Python workers);
- `audit`: how long the batch waited for its audit's source side once the job was done (the
  audit runs beside the job);
- `record`: the batch record, the ledger and the store monitor;
- `lease`: the lease check before the commit.

Whatever `addBatch` and the whole trigger spent beyond the named phases is `other`. Partitions
run in parallel, so `decode` and `write` are the longest partition, not a sum, and `fold` is
what is left of the job's wall time.

An entry goes to `sluice:{stats[:<stage>]}:timings` (newest first, TIMINGS_KEEP kept) when
Spark reports the batch's progress, after it committed: `{batch, events, done_ms, phases}`.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Any

import orjson
from pyspark.sql.streaming import StreamingQueryListener

from sluice.redis.keys import decode_times_key, timings_key
from sluice.status.timings import SLUICE_PHASES, SPARK_PHASES

log = logging.getLogger(__name__)

TIMINGS_KEEP = 600
PENDING_KEEP = 64  # batches measured whose progress has not come yet


class BatchTimings:
    """One streaming query's measurements, per batch, until Spark reports its progress."""

    def __init__(self, client: Any, stage: str) -> None:
        self.client = client
        self.stage = stage
        self.key = timings_key(stage)
        self.decode_key = decode_times_key(stage)
        self._pending: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()

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

    def publish(self, progress: dict[str, Any]) -> None:
        """Spark reported batch `progress["batchId"]`: publish its entry. Never raises."""
        batch = int(progress.get("batchId", -1))
        with self._lock:
            own = self._pending.pop(batch, {})
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
    named = sum(own.get(k, 0.0) for k in SLUICE_PHASES)
    phases.update({k: round(own.get(k, 0.0), 1) for k in SLUICE_PHASES})
    total = float(d.get("triggerExecution", 0))
    spark = sum(phases[k] for k in SPARK_PHASES) + float(d["addBatch"])
    # addBatch beyond Sluice's own steps (the foreachBatch call, building the batch's frame),
    # and the trigger beyond Spark's phases.
    phases["other"] = round(max(0.0, float(d["addBatch"]) - named) + max(0.0, total - spark), 1)
    return {"batch": int(progress.get("batchId", -1)), "events": rows, "total_ms": total,
            "done_ms": _done_ms(progress), "phases": phases}  # fmt: skip


def _done_ms(progress: dict[str, Any]) -> int | None:
    """The batch's end, epoch ms: its trigger's start (`timestamp`) plus its duration."""
    stamp = progress.get("timestamp")
    if not stamp:
        return None
    start = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    total = float((progress.get("durationMs") or {}).get("triggerExecution", 0))
    return int(start.timestamp() * 1000 + total)


class _Listener(StreamingQueryListener):
    """One per Spark session: hands each query's progress to its `BatchTimings`."""

    def __init__(self) -> None:
        self.by_name: dict[str, BatchTimings] = {}

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        try:
            timings = self.by_name.get(event.progress.name or "")
            if timings is not None:
                timings.publish(orjson.loads(event.progress.json))
        except Exception as e:  # noqa: BLE001 - never disturb Spark's listener bus
            log.debug("progress not handled", extra={"error": str(e)})

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass


_listeners: dict[int, _Listener] = {}
_listeners_lock = threading.Lock()


def watch(spark: Any, query_name: str, timings: BatchTimings) -> None:
    """Publish the batches of the query named `query_name` (in `spark`'s session) to
    `timings`. Registers one Spark listener per session, on the first call."""
    with _listeners_lock:
        listener = _listeners.get(id(spark))
        if listener is None:
            listener = _listeners[id(spark)] = _Listener()
            spark.streams.addListener(listener)
    listener.by_name[query_name] = timings
