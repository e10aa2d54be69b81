"""The per-batch time breakdown (`pipeline.timing`, `status.timings`): Spark's phases from a
query progress, Sluice's own steps, and what is left over as `other`."""

from __future__ import annotations

from sluice.pipeline.timing import breakdown
from sluice.status.timings import PHASES, summarize

PROGRESS = {
    "batchId": 7,
    "numInputRows": 2_000,
    "timestamp": "2026-11-24T10:00:00.000Z",
    "durationMs": {
        "latestOffset": 10, "queryPlanning": 40, "walCommit": 30, "addBatch": 600,
        "commitOffsets": 20, "triggerExecution": 720, "getBatch": 0,
    },
}  # fmt: skip


def test_a_batch_splits_into_spark_phases_sluice_steps_and_the_rest() -> None:
    own = {"decode": 100.0, "fold": 250.0, "write": 80.0, "audit": 5.0, "record": 15.0}
    entry = breakdown(PROGRESS, own)
    assert entry is not None
    assert entry["batch"] == 7 and entry["events"] == 2_000 and entry["total_ms"] == 720
    assert entry["done_ms"] == 1795514400000 + 720
    ph = entry["phases"]
    assert set(ph) == set(PHASES)
    assert ph["walCommit"] == 30 and ph["fold"] == 250 and ph["lease"] == 0
    # addBatch 600 - 450 measured = 150, and the trigger's 720 - (100 + 600) = 20 unaccounted.
    assert ph["other"] == 170
    assert sum(ph.values()) == entry["total_ms"]


def test_a_trigger_without_input_is_no_batch() -> None:
    assert breakdown({**PROGRESS, "numInputRows": 0}, {}) is None
    assert breakdown({"batchId": 1, "numInputRows": 5, "durationMs": {}}, {}) is None


def test_summary_takes_medians_per_phase() -> None:
    entries = [
        {"total_ms": t, "events": 10, "phases": {"fold": t / 2, "write": 1.0}}
        for t in (100.0, 300.0, 200.0)
    ]
    s = summarize(entries)
    assert s["batches"] == 3 and s["total_ms"] == 200.0
    assert s["phases_ms"]["fold"] == 100.0 and s["phases_ms"]["decode"] == 0.0
    assert summarize([])["total_ms"] is None


def test_a_batch_written_behind_keeps_its_write_apart_from_its_phases() -> None:
    """Its write, audit and record ran beside the next batch: not in its total."""
    own = {"decode": 100.0, "fold": 250.0, "wait": 50.0, "write": 900.0, "audit": 5.0,
           "record": 15.0, "behind": 1.0}  # fmt: skip
    entry = breakdown(PROGRESS, own)
    assert entry is not None
    assert entry["behind"] == {"write": 900.0, "audit": 5.0, "record": 15.0}
    ph = entry["phases"]
    assert ph["wait"] == 50 and ph["write"] == ph["audit"] == ph["record"] == 0
    assert ph["other"] == 600 - 400 + 20
    assert sum(ph.values()) == entry["total_ms"]
    assert own["write"] == 900.0  # the caller's measurements are left as they were


class _Client:
    def __init__(self) -> None:
        self.pushed: list[bytes] = []

    def pipeline(self, transaction: bool = False) -> _Client:
        return self

    def lpush(self, key: str, value: bytes) -> None:
        self.pushed.append(value)

    def ltrim(self, *args: object) -> None:
        pass

    def execute(self) -> None:
        pass


def test_a_held_batch_is_published_once_its_write_is_done() -> None:
    import orjson

    from sluice.pipeline.timing import BatchTimings

    client = _Client()
    t = BatchTimings(client, "spark")
    t.add(7, decode=100.0, fold=250.0)
    t.hold(7)
    t.publish(PROGRESS)  # Spark reported it; its write still runs
    assert client.pushed == []
    t.add(7, write=900.0, audit=5.0, record=15.0)
    t.done(7)
    (entry,) = [orjson.loads(x) for x in client.pushed]
    assert entry["batch"] == 7 and entry["behind"]["write"] == 900.0
    t.publish(PROGRESS)  # published once
    assert len(client.pushed) == 1
