"""The per-batch XOR completeness audit: seed 003's acker, adapted to micro-batches.

Every source event has a 64-bit id derived from its shard, its entry's position and its index in
the entry (`source.ids.event_ids`). Three XORs are taken per batch:

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

The source side of a batch's first attempt is the one its plan logged with the offsets, where the
log's plan read the entries (`Log.planned_source`); the next attempts read the log again. The
plan's side less a later read's is the events that left the log between the plan and the
batch's read (an `XDEL`, a Redis failover that lost writes its old master had acknowledged):
they are counted (`events_removed`) and logged, never waived in silence.

Each attempt's result goes to the ledger (`status.ledger`), where the status views read it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

from sluice.files import read_text
from sluice.source.log import Admitted, Log
from sluice.source.reader import START_FILE

# Where each log's offset dict keeps its positions (`Log.OFFSETS_FIELD`: streams, Kafka).
OFFSETS_FIELDS = ("ids", "offsets")


def logged_batches(ckpt: Path, log_name: str) -> list[int]:
    """The batch ids in one of the checkpoint's logs (`offsets` or `commits`), ascending."""
    return sorted(int(p.name) for p in (ckpt / log_name).glob("[0-9]*") if p.name.isdigit())


def batch_offsets(ckpt: Path, batch_id: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(start, end) offsets of a batch, as the source logged them in Spark's offset log
    (written before the batch ran). Batch 0 starts where the source began the checkpoint, as
    it kept it beside (`START_FILE`: a Kafka topic's `start: latest`, or its earliest offset
    after retention); {} (each log's origin) for a checkpoint with no such file."""
    end = _logged(ckpt / "offsets" / str(batch_id))
    if end is None:
        raise FileNotFoundError(f"no offset log entry for batch {batch_id} under {ckpt}")
    if batch_id > 0:
        return (_logged(ckpt / "offsets" / str(batch_id - 1)) or {}), end
    kept = read_text(ckpt / START_FILE)
    if kept is None:
        return {}, end
    positions = json.loads(kept)
    return {field: positions for field in OFFSETS_FIELDS if field in end}, end


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


class SourceSide(NamedTuple):
    """A batch's audit source side, how long it took to get (ms), and the events its plan
    admitted that a read of the log no longer found (0 when unknown)."""

    admitted: Admitted
    ms: float
    removed: int


def source_side(log: Log, offsets: tuple[dict[str, Any], dict[str, Any]],
                reread: bool) -> SourceSide:  # fmt: skip
    """The source side of the batch from `offsets` (start, end), as the plan logged it, else
    (or with `reread`) read from the log again. A batch that did not balance reads it again for
    its next attempt: a side planned before the batch ran holds records removed since, which the
    batch's read, and a read now, no longer see."""
    t0 = time.perf_counter()
    spans = log.spans(*offsets)
    planned = log.planned_source(spans, offsets[1])
    if planned is not None and not reread:
        return SourceSide(planned, (time.perf_counter() - t0) * 1000, 0)
    admitted = log.admitted(spans)
    # Kafka's reads say what its retention removed themselves (a `lost_records` dead letter
    # for the run, in the batch's read and in this one alike); a stream's reads cannot.
    removed = 0
    if planned is not None and log.kind == "redis":
        removed = max(0, planned.events - admitted.events)
    return SourceSide(admitted, (time.perf_counter() - t0) * 1000, removed)
