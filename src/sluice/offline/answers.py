"""The answering step of a training set: per row and feature, the states of its parts (the
full slices, t's own slice, the late events; or the window's state by running totals) merged
by `Agg.merge` and answered by `Agg.finalize`, the query server's own code, in `mapInArrow`
tasks; derived features by `formula.evaluate`. Nothing here defines an aggregation again."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sluice import formula
from sluice.config import MetricConfig
from sluice.offline.features import (
    PART_EDGE,
    PART_FULL,
    PART_LATE,
    PART_PREFIX,
    ROW,
    SPINE,
    arrow_column,
    part_column,
)
from sluice.slices.aggs import AGGS, BLOB, HLL, Agg


@dataclass(frozen=True)
class AnswerPlan:
    """What the answering tasks need (plain, picklable): the base metrics and the features."""

    metrics: tuple[tuple[MetricConfig, bool, tuple[int, ...]], ...]  # (metric, integral, windows)
    features: tuple[tuple[str, str, int], ...]  # (column, metric or derived name, window ms)
    derived: tuple[tuple[str, str], ...]  # (name, formula text)
    types: dict[str, str]  # feature column -> Spark type
    prefix: frozenset[int] = frozenset()  # metrics merged by running totals (`offline.prefix`)


def _texts(agg: Agg, n: pa.Array, folds: list[pa.Array]) -> list[bytes | None]:
    """Each cell state as stored (`token:v1:...`, token 0), or None where it holds no value."""
    if agg.state == HLL:
        return [None] * len(n)  # members, not numbers: see `_members`
    if agg.state == BLOB:
        return [None if b is None else b"0:" + b for b in folds[0].to_pylist()]
    assert agg.numbers is not None
    texts = pc.binary_join_element_wise("0", *agg.encode(n, *folds), ":")
    ok = pc.fill_null(pc.greater(n, 0), False)
    return [t.encode() if t is not None else None for t in pc.if_else(ok, texts, None).to_pylist()]


def _part(
    batch: pa.RecordBatch, mi: int, part: str, agg: Agg, w: int | None = None
) -> tuple[list[Any], list[Any]]:
    """One part's states per row (a list of None or one state) and, for distinct, members."""
    names = batch.schema.names
    n_name = part_column(mi, part, "n", w)
    if n_name not in names:
        return [[] for _ in range(batch.num_rows)], [[] for _ in range(batch.num_rows)]
    n = batch.column(names.index(n_name))
    folds = [batch.column(names.index(part_column(mi, part, f.column, w))) for f in agg.folds]
    texts = _texts(agg, n, folds)
    members: list[Any] = folds[0].to_pylist() if agg.state == HLL else [None] * len(texts)
    return [[t] if t is not None else [] for t in texts], [m or [] for m in members]


def _collected(batch: pa.RecordBatch, mi: int, agg: Agg, w: int) -> tuple[list[Any], list[Any]]:
    """The full slices' cell states per row, from a collected list of (n, folds...)."""
    lists = batch.column(batch.schema.names.index(part_column(mi, PART_FULL, "cells", w)))
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    flat = pc.list_flatten(lists)
    offsets = pc.list_value_length(lists).to_pylist()
    n = pc.struct_field(flat, "n")
    folds = [pc.struct_field(flat, f.column) for f in agg.folds]
    texts = _texts(agg, n, folds)
    members = folds[0].to_pylist() if agg.state == HLL else None
    states: list[Any] = []
    sets: list[Any] = []
    at = 0
    for length in offsets:
        length = length or 0
        states.append([t for t in texts[at : at + length] if t is not None])
        sets.append([x for ms in members[at : at + length] for x in (ms or [])] if members else [])
        at += length
    return states, sets


def _prefixed(batch: pa.RecordBatch, mi: int, agg: Agg, w: int, ok: Any,
              integral: bool) -> pa.Array:  # fmt: skip
    """A window's answers from its state merged by running totals, on columns
    (`Agg.finalize_columns`, held to `Agg.finalize`); null where the row has no key or time."""
    assert agg.finalize_columns is not None, agg.name
    names = batch.schema.names

    def column(name: str, blank: Any) -> Any:
        values = pc.fill_null(batch.column(names.index(name)), blank)
        return values.to_numpy(zero_copy_only=False)

    has = column(part_column(mi, PART_PREFIX, "has", w), False)
    numbers = [column(part_column(mi, PART_PREFIX, f"x{j}", w), 0.0) for j in range(agg.width)]
    values, valid = agg.finalize_columns(has, numbers, integral)
    valid = ok if valid is None else valid & ok
    return pa.array(values, mask=~valid)


def answer_batches(plan: AnswerPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: per row, every feature's value (`Agg.merge` then `Agg.finalize`)."""
    from sluice.slices.hll import estimate

    parsed = {name: formula.parse(text) for name, text in plan.derived}
    for batch in batches:
        rows = batch.num_rows
        values: dict[tuple[str, int], list[Any] | pa.Array] = {}
        for mi, (mcfg, integral, windows) in enumerate(plan.metrics):
            agg = AGGS[mcfg.agg]
            ok_column = batch.column(batch.schema.names.index(part_column(mi, "", "ok")))
            if mi in plan.prefix:
                ok_mask = pc.fill_null(ok_column, False).to_numpy(zero_copy_only=False)
                for wi, w_ms in enumerate(windows):
                    values[(mcfg.name, w_ms)] = _prefixed(batch, mi, agg, wi, ok_mask, integral)
                continue
            ok = ok_column.to_pylist()
            edge, edge_sets = _part(batch, mi, PART_EDGE, agg)
            for wi, w_ms in enumerate(windows):
                if agg.collects:
                    full, full_sets = _collected(batch, mi, agg, wi)
                else:
                    full, full_sets = _part(batch, mi, PART_FULL, agg, wi)
                late, late_sets = _part(batch, mi, PART_LATE, agg, wi)
                out: list[Any] = []
                for i in range(rows):
                    if not ok[i]:
                        out.append(None)
                    elif agg.state == HLL:
                        members = {*full_sets[i], *edge_sets[i], *late_sets[i]}
                        out.append(agg.finalize(estimate(members), mcfg, integral))
                    else:
                        merged = agg.merge([*full[i], *late[i], *edge[i]])
                        out.append(agg.finalize(merged, mcfg, integral))
                values[(mcfg.name, w_ms)] = out
        cols: list[pa.Array] = [batch.column(batch.schema.names.index(ROW))]
        for column, name, w_ms in plan.features:
            if name in parsed:
                inputs = {n: _listed(values[(n, w_ms)]) for n in formula.names(parsed[name])}
                vals = [
                    formula.evaluate(parsed[name], {n: xs[i] for n, xs in inputs.items()})
                    for i in range(rows)
                ]
                cols.append(arrow_column(vals, "double"))
            else:
                cols.append(arrow_column(values[(name, w_ms)], plan.types[column]))
        names = [ROW, *[c for c, _, _ in plan.features]]
        if SPINE in batch.schema.names:  # the spine's columns ride along
            cols.append(batch.column(batch.schema.names.index(SPINE)))
            names.append(SPINE)
        yield pa.RecordBatch.from_arrays(cols, names=names)


def _listed(values: list[Any] | pa.Array) -> list[Any]:
    return values.to_pylist() if isinstance(values, pa.Array) else values


def cell_states(agg: Agg, cells: list[dict[str, Any]]) -> list[bytes]:
    """Folded cells (dicts of `n` and the agg's fold columns), in the order the query server
    reads their slices, as the stored states `Agg.merge` takes."""
    if not cells:
        return []
    n = pa.array([c["n"] for c in cells], pa.int64())
    folds = [pa.array([c[f.column] for c in cells]) for f in agg.folds]
    return [t for t in _texts(agg, n, folds) if t is not None]
