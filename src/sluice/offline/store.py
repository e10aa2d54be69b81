"""Training-set values from the slice store itself, for what it still holds.

Without an archive, a spine row at time t is answered by the query engine (`QueryEngine.run`,
the server's own code) at end = t, but only where the store's slices give exactly the events up
to t: a slice holds every event of its interval, including those after t, so a row is answered
only when t is the last millisecond of a slice of each metric it reads ((t + 1) is a multiple of
the metric's finest slice), and only while the window lies within the metric's retention
measured from the store's clock now. Every other value is null, and the row's
`sluice_unanswered` column says which feature and why, rather than answering wrongly.

The store holds a metric's history only where something wrote it: each backfill run the
slices from its start (`--start`, 0 for a run over the whole archive) to its seam, the live
fold those from its first whole slice after it began folding the metric
(`sluice:{stats}:folding`). A window is answered only where their union covers it with no gap
(`status.coverage.Written`). A window in a gap (between two runs, or between a seam and a
later start of the live fold), or one that reaches before or past what they wrote,
is refused with its reason, as is a window that starts less than `TRIM_MARGIN_MS` after the
oldest slice every key still holds (the live fold may trim it while the job reads), and a t
less than `SETTLE_MS` before the store's clock (its slices may still be filling).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.config import Config
from sluice.errors import SluiceError
from sluice.offline.features import ROW, SLICE_T, Feature, arrow_column, key_text
from sluice.pipeline.definitions import check_definitions
from sluice.query.engine import Lookup, QueryEngine
from sluice.redis.connection import client_for, server_now_ms
from sluice.slices.window import slice_start
from sluice.status.coverage import Spans, Written, read_written
from sluice.units import format_duration_ms, iso_ms

UNANSWERED = "sluice_unanswered"
LOOKUPS_PER_CALL = 1000
SETTLE_MS = 2_000  # as `sluice consistency --settle`: a slice this recent may still be filling
# A key keeps its newest slice and the `retention` before it, and the live fold may move that on
# while the job reads: windows must start this much after the oldest slice every key holds now
# (of the finest length: a window's start is read from those).
TRIM_MARGIN_MS = 15 * 60_000


@dataclass(frozen=True)
class _StorePlan:
    cfg: Config
    url: str
    now_ms: int
    features: tuple[tuple[str, str, int], ...]  # (column, name, window ms)
    keys: tuple[tuple[str, tuple[str, ...]], ...]  # per feature name: its key columns (as read)
    types: dict[str, str]
    written: dict[str, Written]  # per metric: what wrote its slices, and since when


def _bases(cfg: Config, name: str) -> list[Any]:
    return [cfg.metric(n) for n in cfg.stored_inputs(name)]


def _why_not(plan: _StorePlan, name: str, t: int, w_ms: int) -> str | None:
    """Why the store cannot answer (name, window) at t exactly, or None when it can."""
    if t > plan.now_ms - SETTLE_MS:
        return (
            f"t is not yet {SETTLE_MS // 1000} s past by the store's clock"
            f" ({iso_ms(plan.now_ms)}): its slices may still be filling; give --input"
        )
    for m in _bases(plan.cfg, name):
        lengths = m.slice_lengths()
        finest, coarsest = lengths[0], lengths[-1]
        if (t + 1) % finest:
            return (
                f"t is inside a {format_duration_ms(finest)} slice of {m.name!r}: the store"
                " cannot leave out its events after t; give --input"
            )
        lo = slice_start(t - w_ms + 1, finest)
        held_from = slice_start(plan.now_ms, finest) - m.retention
        if w_ms > m.retention or lo < held_from + TRIM_MARGIN_MS:
            return (
                f"the window reaches past {m.name!r}'s retention, or within"
                f" {format_duration_ms(TRIM_MARGIN_MS)} of it (slices from"
                f" {iso_ms(held_from + TRIM_MARGIN_MS)} on stay while this runs); give --input"
            )
        why = _uncovered(m.name, lo, t + 1, coarsest, plan.written.get(m.name, Written()))
        if why is not None:
            return why
    return None


def _uncovered(name: str, lo: int, hi: int, coarsest: int, w: Written) -> str | None:
    """Why the slices [lo, hi) of `name` are not all written by backfills (each run from its
    start to its seam: `w.spans`) or the live fold (from its first whole coarsest slice after
    `w.began`), or None."""
    gap = w.gap(lo, hi, coarsest)
    if gap is None:
        return None
    at, until = gap
    seam, live_from = w.seam, w.live_from(coarsest)
    if seam is None and live_from is None:
        return f"the store holds nothing of {name!r}: no backfill and no live fold wrote it"
    if seam is None:
        return (
            f"the window starts before the live fold began folding {name!r}"
            f" ({iso_ms(live_from or 0)}) and no backfill wrote its history; give --input"
        )
    first = w.spans[0][0]
    if at < first and (live_from is None or at < live_from):
        return (
            f"the window starts before the history a backfill wrote of {name!r} (from"
            f" {iso_ms(first)}: it ran with --start); give --input"
        )
    if at >= seam and live_from is None:
        return (
            f"the window reaches past {name!r}'s backfill seam ({iso_ms(seam)}) and the"
            " live fold has not folded it; give --input"
        )
    if at >= seam:
        return (
            f"the window reaches into the gap between {name!r}'s backfill seam ({iso_ms(seam)})"
            f" and the live fold's first slice of it ({iso_ms(live_from or 0)}); give --input"
        )
    return (
        f"the window reaches into [{iso_ms(at)}, {iso_ms(until)}), which no backfill of"
        f" {name!r} wrote (its runs wrote {_spans_said(w.spans)}) and the live fold did not;"
        " give --input, or backfill that span"
    )


def _spans_said(spans: Spans) -> str:
    return ", ".join(f"[{iso_ms(a)}, {iso_ms(b)})" for a, b in spans)


def _answer(plan: _StorePlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    client = client_for(plan.url, timeout_s=60)
    engine = QueryEngine(plan.cfg, client)
    keys = dict(plan.keys)
    try:
        for batch in batches:
            rows = batch.to_pylist()
            values: dict[str, list[Any]] = {c: [None] * len(rows) for c, _, _ in plan.features}
            missing: list[list[str]] = [[] for _ in rows]
            asks: list[tuple[int, str, Lookup]] = []
            for i, row in enumerate(rows):
                t = row[SLICE_T]
                for column, name, w_ms in plan.features:
                    key = [row[c] for c in keys[name]]
                    if t is None or any(k is None for k in key):
                        missing[i].append(f"{column}: no time or key")
                        continue
                    why = _why_not(plan, name, t, w_ms)
                    if why is not None:
                        missing[i].append(f"{column}: {why}")
                        continue
                    asks.append((i, column, Lookup(name, tuple(map(str, key)), w_ms, t)))
            for at in range(0, len(asks), LOOKUPS_PER_CALL):
                chunk = asks[at : at + LOOKUPS_PER_CALL]
                for (i, column, _), ans in zip(
                    chunk, engine.run([a[2] for a in chunk]), strict=True
                ):
                    values[column][i] = ans["value"]
            cols = [pa.array([r[ROW] for r in rows], pa.int64())]
            cols += [arrow_column(values[c], plan.types[c]) for c, _, _ in plan.features]
            cols.append(pa.array(missing, pa.list_(pa.string())))
            names = [ROW, *[c for c, _, _ in plan.features], UNANSWERED]
            yield pa.RecordBatch.from_arrays(cols, names=names)
    finally:
        client.close()


def store_values(
    spark: SparkSession,
    cfg: Config,
    spine_in: DataFrame,
    t_ms: Column,
    keys: Mapping[str, str],
    feats: list[Feature],
    types: dict[str, str],
    url: str | None,
) -> DataFrame:
    """`training_set` without an archive (module docstring). `spine_in` carries the row ids."""
    if url is None:
        raise SluiceError("no store to read: set `redis:` or give the archive with --input")
    client = client_for(url)
    try:
        bases = {m.name for f in feats for m in _bases(cfg, f.name)}
        check_definitions(client, cfg, sorted(bases), register=False)  # slices it would misread
        now_ms = server_now_ms(client)
        written = read_written(client)
    finally:
        client.close()
    key_cols: dict[str, tuple[str, ...]] = {}
    wanted: dict[str, Column] = {}
    for f in feats:
        fields = _bases(cfg, f.name)[0].key
        key_cols[f.name] = tuple(f"_k_{field}" for field in fields)
        for field in fields:
            wanted[f"_k_{field}"] = key_text(F.col(f"`{keys.get(field, field)}`"),
                                             cfg.source.schema_[field])  # fmt: skip
    plan = _StorePlan(
        cfg=cfg,
        url=url,
        now_ms=now_ms,
        features=tuple((f.column, f.name, f.window_ms) for f in feats),
        keys=tuple(key_cols.items()),
        types=types,
        written=written,
    )
    narrow = spine_in.select(ROW, t_ms, *[c.alias(n) for n, c in wanted.items()])
    ddl = ", ".join(
        [f"{ROW} long", *[f"`{f.column}` {types[f.column]}" for f in feats],
         f"{UNANSWERED} array<string>"]
    )  # fmt: skip
    answers = narrow.mapInArrow(partial(_answer, plan), ddl)
    return spine_in.join(answers, ROW, "left").orderBy(ROW).drop(ROW)  # the spine's order
