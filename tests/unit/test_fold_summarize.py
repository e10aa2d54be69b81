"""sluice.pipeline.writer.summarize: folding the writer's per-partition rows into a batch record."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.pipeline.query import writer_token
from sluice.pipeline.writer import RESULT_DDL, RESULT_SCHEMA, summarize

FAST = settings(max_examples=80, deadline=None, database=None)


def stats(
    events: int,
    min_ems: int | None,
    max_ems: int | None,
    applied: int = 0,
    dups: int = 0,
    expired: int = 0,
    write_ms: float | None = None,
    fold_rows: int = 0,
    fold_cells: int = 0,
) -> dict[str, Any]:
    """A `stats` row as the writer emits it (see writer.write_partition)."""
    return {
        "kind": "stats",
        "m": None,
        "updates_applied": applied,
        "updates_duplicate": dups,
        "updates_expired": expired,
        "events": events,
        "fold_rows": fold_rows,
        "fold_cells": fold_cells,
        "min_ems": min_ems,
        "max_ems": max_ems,
        "reason": None,
        "write_ms": write_ms,
    }


def dead(reason: str, events: int) -> dict[str, Any]:
    return {
        "kind": "dead",
        "m": None,
        "updates_applied": None,
        "updates_duplicate": None,
        "updates_expired": None,
        "events": events,
        "min_ems": None,
        "max_ems": None,
        "reason": reason,
    }


def as_writer_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round-trip through RESULT_SCHEMA, as Spark's collect() + asDict() would deliver them."""
    return pa.RecordBatch.from_pylist(rows, schema=RESULT_SCHEMA).to_pylist()


def test_result_schema_and_ddl_agree() -> None:
    ddl_names = [part.strip().split()[0] for part in RESULT_DDL.split(",")]
    assert ddl_names == RESULT_SCHEMA.names


def test_no_rows() -> None:
    rec = summarize([], batch_id=3, token=7, started_ms=100, done_ms=250)
    assert rec == {
        "batch": 3,
        "token": 7,
        "events": 0,
        "dead": 0,
        "updates_applied": 0,
        "updates_duplicate": 0,
        "updates_expired": 0,
        "updates_before_seam": 0,
        "min_ems": None,
        "max_ems": None,
        "started_ms": 100,
        "done_ms": 250,
        "write_ms": None,
        "write_updates": 0,
        "fold_rows": 0,
        "fold_cells": 0,
        "dead_by_reason": {},
    }


def test_folds_stats_and_dead_rows() -> None:
    rows = as_writer_rows(
        [
            stats(10, 1_000, 2_000, applied=5, dups=1, expired=0),
            dead("bad_type", 2),
            stats(0, None, None),
            stats(7, 500, 1_500, applied=3, dups=0, expired=2),
            dead("missing_field", 1),
            dead("bad_type", 4),
        ]
    )
    rec = summarize(rows, batch_id=42, token=writer_token(2, 42), started_ms=1, done_ms=9)
    assert rec["batch"] == 42
    assert rec["token"] == writer_token(2, 42)
    assert rec["dead"] == 7
    assert rec["events"] == 10 + 7 + 7  # good events plus dead ones
    assert rec["updates_applied"] == 8
    assert rec["updates_duplicate"] == 1
    assert rec["updates_expired"] == 2
    assert rec["min_ems"] == 500
    assert rec["max_ems"] == 2_000
    assert rec["dead_by_reason"] == {"bad_type": 6, "missing_field": 1}
    assert (rec["started_ms"], rec["done_ms"]) == (1, 9)


def test_only_dead_rows_leave_times_unset() -> None:
    rec = summarize(as_writer_rows([dead("non_finite", 3)]), 0, 0, 0, 0)
    assert rec["events"] == rec["dead"] == 3
    assert rec["min_ems"] is None and rec["max_ems"] is None
    assert rec["updates_applied"] == 0


def test_unknown_kinds_are_ignored() -> None:
    rows = [stats(2, 10, 20), {"kind": "other", "events": 99}]
    rec = summarize(rows, 0, 0, 0, 0)
    assert rec["events"] == 2


stats_rows = st.builds(
    lambda n, lo, width, a, d, e, rows, cells: stats(
        n, lo, None if lo is None else lo + width, a, d, e, None, rows, cells
    ),
    st.integers(0, 10_000),
    st.one_of(st.none(), st.integers(0, 2 * 10**12)),
    st.integers(0, 10**6),
    st.integers(0, 10**5),
    st.integers(0, 10**5),
    st.integers(0, 10**5),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)
dead_rows = st.builds(
    dead, st.sampled_from(["bad_type", "missing_field", "too_long"]), st.integers(1, 100)
)


@FAST
@given(st.lists(st.one_of(stats_rows, dead_rows), max_size=20))
def test_summarize_matches_a_direct_fold(rows: list[dict[str, Any]]) -> None:
    rec = summarize(as_writer_rows(rows), 1, 2, 3, 4)
    s = [r for r in rows if r["kind"] == "stats"]
    d = [r for r in rows if r["kind"] == "dead"]
    assert rec["dead"] == sum(r["events"] for r in d)
    assert rec["events"] == sum(r["events"] for r in s) + rec["dead"]
    assert rec["updates_applied"] == sum(r["updates_applied"] for r in s)
    assert rec["updates_duplicate"] == sum(r["updates_duplicate"] for r in s)
    assert rec["updates_expired"] == sum(r["updates_expired"] for r in s)
    assert rec["fold_rows"] == sum(r["fold_rows"] for r in s)
    assert rec["fold_cells"] == sum(r["fold_cells"] for r in s)
    lows = [r["min_ems"] for r in s if r["min_ems"] is not None]
    highs = [r["max_ems"] for r in s if r["max_ems"] is not None]
    assert rec["min_ems"] == (min(lows) if lows else None)
    assert rec["max_ems"] == (max(highs) if highs else None)
    assert sum(rec["dead_by_reason"].values()) == rec["dead"]
    for reason, n in rec["dead_by_reason"].items():
        assert n == sum(r["events"] for r in d if r["reason"] == reason)
    # Order of partitions does not matter.
    assert summarize(as_writer_rows(rows[::-1]), 1, 2, 3, 4) == rec


def test_write_ms_is_the_slowest_partition() -> None:
    """The store's latency signal (flow.stages.store_level) is the slowest partition's write."""
    rows = [
        stats(5, 1, 2, applied=900, write_ms=12.25),
        stats(3, 1, 2, applied=40, dups=2, expired=1, write_ms=480.04),
        stats(0, None, None),
    ]
    rec = summarize(as_writer_rows(rows), batch_id=1, token=1, started_ms=0, done_ms=1)
    assert rec["write_ms"] == 480.0
    assert rec["write_updates"] == 43  # that partition's, for its time per update
