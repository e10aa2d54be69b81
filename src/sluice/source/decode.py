"""Decode raw stream entries into Arrow record batches, and flag bad events instead of failing.

Input is what XRANGE returns without client-side parsing: `[[id, [f1, v1, f2, v2, ...]], ...]`
with every element as bytes. Output columns are the schema fields followed by:

    _ts   long    event time in ms (the time field, or the entry id's time when it is missing)
    _ems  long    the entry id's time (when Redis accepted the entry)
    _ref  long    the batch's reference time: the newest entry time of the batch's end offset
    _err  string  null for a good event, else the dead-letter reason
    _field string the offending field, when there is one
    _eid  string  the stream entry id, for bad events only
    _idx  int     the event's index within its entry
    _raw  string  the offending input, truncated, for bad events only

Each chunk of entries is first decoded with vectorised Arrow casts. Only a chunk in which a cast
fails is decoded again event by event, to find which events are bad and why; so a trickle of bad
input costs little, and nothing in a bad chunk is lost or blamed on its neighbours.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from sluice.source.ids import parse_id
from sluice.source.options import SourceOptions

ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "long": pa.int64(),
    "int": pa.int32(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
}
META_FIELDS: list[tuple[str, pa.DataType]] = [
    ("_ts", pa.int64()),
    ("_ems", pa.int64()),
    ("_ref", pa.int64()),
    ("_err", pa.string()),
    ("_field", pa.string()),
    ("_eid", pa.string()),
    ("_idx", pa.int32()),
    ("_raw", pa.string()),
]
SPARK_TYPES = {
    "string": "string",
    "long": "bigint",
    "int": "int",
    "double": "double",
    "float": "float",
    "boolean": "boolean",
}
RAW_LIMIT = 1024
CHUNK_ENTRIES = 4096
_INT_RANGE = {"long": (-(2**63), 2**63 - 1), "int": (-(2**31), 2**31 - 1)}


def output_schema(opts: SourceOptions) -> pa.Schema:
    fields = [pa.field(n, ARROW_TYPES[t], nullable=True) for n, t, _ in opts.fields]
    return pa.schema(fields + [pa.field(n, t, nullable=True) for n, t in META_FIELDS])


def spark_schema_ddl(opts: SourceOptions) -> str:
    cols = [f"`{n}` {SPARK_TYPES[t]}" for n, t, _ in opts.fields]
    meta = {
        "_ts": "bigint",
        "_ems": "bigint",
        "_ref": "bigint",
        "_err": "string",
        "_field": "string",
        "_eid": "string",
        "_idx": "int",
        "_raw": "string",
    }
    return ", ".join(cols + [f"`{k}` {v}" for k, v in meta.items()])


class _Bad(Exception):
    def __init__(self, reason: str, field: str | None = None) -> None:
        self.reason = reason
        self.field = field


def _truncate(raw: bytes | str) -> str:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return text if len(text) <= RAW_LIMIT else text[:RAW_LIMIT] + "…"


def _convert_text(value: bytes, typ: str, name: str, max_bytes: int) -> Any:
    """Convert one `fields`-format value (bytes) to its Python value, or raise _Bad."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("invalid_utf8", name) from None
    if typ == "string":
        if len(value) > max_bytes:
            raise _Bad("too_long", name)
        return text
    if typ in ("long", "int"):
        try:
            v = int(text.strip())
        except ValueError:
            raise _Bad("bad_type", name) from None
        lo, hi = _INT_RANGE[typ]
        if not lo <= v <= hi:
            raise _Bad("out_of_range", name)
        return v
    if typ in ("double", "float"):
        try:
            f = float(text)
        except ValueError:
            raise _Bad("bad_type", name) from None
        if not math.isfinite(f):
            raise _Bad("non_finite", name)
        return f
    low = text.strip().lower()
    if low in ("true", "1"):
        return True
    if low in ("false", "0"):
        return False
    raise _Bad("bad_type", name)


def _convert_json(value: Any, typ: str, name: str, max_bytes: int) -> Any:
    """Check one decoded JSON value against its declared type, or raise _Bad."""
    if typ == "string":
        if not isinstance(value, str):
            raise _Bad("bad_type", name)
        if len(value.encode("utf-8", errors="replace")) > max_bytes:
            raise _Bad("too_long", name)
        return value
    if typ in ("long", "int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad("bad_type", name)
        lo, hi = _INT_RANGE[typ]
        if not lo <= value <= hi:
            raise _Bad("out_of_range", name)
        return value
    if typ in ("double", "float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Bad("bad_type", name)
        f = float(value)
        if not math.isfinite(f):
            raise _Bad("non_finite", name)
        return f
    if not isinstance(value, bool):
        raise _Bad("bad_type", name)
    return value


class Decoder:
    """Turns raw entries into record batches. One per `read()` call; holds no connections."""

    def __init__(self, opts: SourceOptions, ref_ms: int) -> None:
        self.opts = opts
        self.ref_ms = ref_ms
        self.schema = output_schema(opts)
        self.names = [n for n, _, _ in opts.fields]
        self.bnames = [n.encode() for n in self.names]
        self.json_schema = pa.schema([(n, ARROW_TYPES[t]) for n, t, _ in opts.fields])

    def decode(self, entries: Sequence[Sequence[Any]]) -> Iterator[pa.RecordBatch]:
        for i in range(0, len(entries), CHUNK_ENTRIES):
            chunk = entries[i : i + CHUNK_ENTRIES]
            if self.opts.format == "jsonl":
                yield self._jsonl(chunk)
            else:
                yield self._fields(chunk)

    # -- fields format: one event per entry -------------------------------------------------

    def _fields(self, chunk: Sequence[Sequence[Any]]) -> pa.RecordBatch:
        maps = [dict(zip(fl[0::2], fl[1::2], strict=False)) for _, fl in chunk]
        ems = [parse_id(e[0])[0] for e in chunk]
        counts = np.ones(len(chunk), dtype=np.int64)
        cols = self._fast_fields(maps)
        if cols is not None:
            return self._finish(chunk, counts, ems, cols, None, lambda i: orjson_fields(maps[i]))
        values: list[list[Any]] = [[] for _ in self.names]
        errs: list[tuple[str, str | None] | None] = []
        for m in maps:
            row: list[Any] = []
            err: tuple[str, str | None] | None = None
            if not m:
                err = ("empty_entry", None)
            for (name, typ, _), bname in zip(self.opts.fields, self.bnames, strict=True):
                raw = m.get(bname)
                if raw is None or err is not None:
                    row.append(None)
                    continue
                try:
                    row.append(_convert_text(raw, typ, name, self.opts.max_string_bytes))
                except _Bad as b:
                    err = (b.reason, b.field)
                    row.append(None)
            for j, v in enumerate(row):
                values[j].append(v)
            errs.append(err)
        cols = {
            n: pa.array(values[j], type=ARROW_TYPES[t])
            for j, (n, t, _) in enumerate(self.opts.fields)
        }
        return self._finish(chunk, counts, ems, cols, errs, lambda i: orjson_fields(maps[i]))

    def _fast_fields(self, maps: list[dict[bytes, bytes]]) -> dict[str, pa.Array] | None:
        cols: dict[str, pa.Array] = {}
        try:
            for (name, typ, _), bname in zip(self.opts.fields, self.bnames, strict=True):
                raw = pa.array([m.get(bname) for m in maps], type=pa.binary())
                text = pc.cast(raw, pa.string())
                if typ == "string":
                    cols[name] = text
                elif typ == "boolean":
                    cols[name] = pc.cast(pc.utf8_lower(pc.utf8_trim_whitespace(text)), pa.bool_())
                else:
                    cols[name] = pc.cast(text, ARROW_TYPES[typ])
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
            return None
        if any(not m for m in maps):
            return None
        return cols

    # -- jsonl format: many events per entry, newline-separated JSON objects in field `d` ---

    def _jsonl(self, chunk: Sequence[Sequence[Any]]) -> pa.RecordBatch:
        maps = [dict(zip(fl[0::2], fl[1::2], strict=False)) for _, fl in chunk]
        ems = [parse_id(e[0])[0] for e in chunk]
        # Blank lines (a trailing newline, say) are not events.
        payloads = [_strip_blank(m.get(b"d")) for m in maps]
        if all(p for p in payloads):
            counts = np.fromiter(
                (p.count(b"\n") + 1 for p in payloads),  # type: ignore[union-attr]
                dtype=np.int64,
                count=len(payloads),
            )
            table = self._read_json(b"\n".join(payloads))  # type: ignore[arg-type]
            if table is not None and table.num_rows == int(counts.sum()):
                cols = {n: table.column(n).combine_chunks() for n in self.names}
                lines: list[bytes] | None = None

                def raw_of(i: Any) -> str:
                    nonlocal lines
                    if lines is None:
                        lines = [ln for p in payloads for ln in p.split(b"\n")]  # type: ignore[union-attr]
                    return _truncate(lines[i])

                return self._finish(chunk, counts, ems, cols, None, raw_of)
        return self._jsonl_slow(chunk, maps, ems)

    def _read_json(self, buf: bytes) -> pa.Table | None:
        try:
            # Arrow's JSON reader does not check that strings are UTF-8; the slow path does.
            buf.decode("utf-8")
            return pa_json.read_json(
                io.BytesIO(buf),
                read_options=pa_json.ReadOptions(block_size=max(1 << 20, len(buf) + 1)),
                parse_options=pa_json.ParseOptions(
                    explicit_schema=self.json_schema, unexpected_field_behavior="ignore"
                ),
            )
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
            return None

    def _jsonl_slow(
        self, chunk: Sequence[Sequence[Any]], maps: list[dict[bytes, bytes]], ems: list[int]
    ) -> pa.RecordBatch:
        values: list[list[Any]] = [[] for _ in self.names]
        errs: list[tuple[str, str | None] | None] = []
        raws: list[str] = []
        counts = np.zeros(len(chunk), dtype=np.int64)
        for k, m in enumerate(maps):
            payload = _strip_blank(m.get(b"d"))
            lines = payload.split(b"\n") if payload else [b""]
            counts[k] = len(lines)
            for line in lines:
                row: list[Any] = [None] * len(self.names)
                err: tuple[str, str | None] | None = None
                if payload is None:
                    err = ("empty_entry", None) if not m else ("missing_field", "d")
                elif not payload:
                    err = ("empty_entry", None)
                else:
                    try:
                        obj = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        try:
                            line.decode("utf-8")
                            err = ("bad_json", None)
                        except UnicodeDecodeError:
                            err = ("invalid_utf8", None)
                    else:
                        if not isinstance(obj, dict):
                            err = ("not_object", None)
                        else:
                            for j, (name, typ, _) in enumerate(self.opts.fields):
                                v = obj.get(name)
                                if v is None:
                                    continue
                                try:
                                    row[j] = _convert_json(v, typ, name, self.opts.max_string_bytes)
                                except _Bad as b:
                                    err = (b.reason, b.field)
                                    row = [None] * len(self.names)
                                    break
                for j, v in enumerate(row):
                    values[j].append(v)
                errs.append(err)
                raws.append(_truncate(line if payload is not None else orjson_fields(m)))
        cols = {
            n: pa.array(values[j], type=ARROW_TYPES[t])
            for j, (n, t, _) in enumerate(self.opts.fields)
        }
        return self._finish(chunk, counts, ems, cols, errs, lambda i: raws[i])

    # -- shared tail: validation, meta columns ----------------------------------------------

    def _finish(
        self,
        chunk: Sequence[Sequence[Any]],
        counts: np.ndarray,
        ems_per_entry: list[int],
        cols: dict[str, pa.Array],
        errs: list[tuple[str, str | None] | None] | None,
        raw_of: Any,
    ) -> pa.RecordBatch:
        n = int(counts.sum())
        err = np.full(n, None, dtype=object)
        field = np.full(n, None, dtype=object)
        if errs is not None:
            for i, e in enumerate(errs):
                if e is not None:
                    err[i], field[i] = e

        def flag(mask: pa.Array, reason: str, name: str) -> None:
            if not pc.any(mask).as_py():
                return
            hit = mask.to_numpy(zero_copy_only=False) & (err == None)  # noqa: E711
            err[hit] = reason
            field[hit] = name

        for name, typ, nullable in self.opts.fields:
            col = cols[name]
            if not nullable:
                flag(pc.is_null(col), "missing_field", name)
            if typ in ("double", "float"):
                flag(pc.invert(pc.fill_null(pc.is_finite(col), True)), "non_finite", name)
            elif typ == "string":
                too_long = pc.greater(pc.binary_length(col), self.opts.max_string_bytes)
                flag(pc.fill_null(too_long, False), "too_long", name)

        ems = pa.array(np.repeat(np.asarray(ems_per_entry, dtype=np.int64), counts))
        starts = np.cumsum(counts) - counts
        idx = pa.array((np.arange(n, dtype=np.int64) - np.repeat(starts, counts)).astype(np.int32))
        if self.opts.time_field is not None:
            ts = pc.coalesce(pc.cast(cols[self.opts.time_field], pa.int64()), ems)
        else:
            ts = ems
        bad = np.flatnonzero(err != None)  # noqa: E711
        eid = np.full(n, None, dtype=object)
        raw = np.full(n, None, dtype=object)
        if len(bad):
            entry_of = np.repeat(np.arange(len(chunk)), counts)
            for row in bad.tolist():
                e_id = chunk[entry_of[row]][0]
                eid[row] = e_id.decode() if isinstance(e_id, bytes) else str(e_id)
                raw[row] = raw_of(row)
        arrays = [cols[name] for name in self.names] + [
            ts,
            ems,
            pa.array(np.full(n, self.ref_ms, dtype=np.int64)),
            pa.array(err, type=pa.string()),
            pa.array(field, type=pa.string()),
            pa.array(eid, type=pa.string()),
            idx,
            pa.array(raw, type=pa.string()),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _strip_blank(payload: bytes | None) -> bytes | None:
    """The payload without blank lines (None stays None, so a missing `d` is still seen)."""
    if payload is None:
        return None
    if b"\n\n" in payload or payload[:1] == b"\n" or payload[-1:] in (b"\n", b"\r"):
        return b"\n".join(ln for ln in payload.splitlines() if ln.strip())
    return payload


def orjson_fields(m: dict[bytes, bytes]) -> str:
    """A readable JSON rendering of a `fields` entry, for the dead-letter record."""
    return _truncate(
        orjson.dumps(
            {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in m.items()}
        )
    )
