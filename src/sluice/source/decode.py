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
    _e    long    the event's 64-bit id, from (stream, entry id, _idx): see source.ids.event_ids

How many events an entry holds is `entry_event_count` (one rule, also applied by the
completeness audit): one per `fields` entry, one per non-blank line of a `jsonl` entry's `d`,
and one dead letter for an entry that is empty, has no `d`, has only blank lines or is over
`max_entry_bytes`. A bad event never takes its neighbours down with it.

The dead-letter reasons (`_err`) the decoder sets are `DECODE_REASONS`:

    missing_field   a non-nullable field is absent or null (`_field` names it; `d` in jsonl)
    bad_type        a value of the wrong type, or text that does not parse as its type
    invalid_utf8    bytes that are not UTF-8 (or a JSON string with a lone surrogate)
    non_finite      NaN or ±infinity in a double or float field
    too_long        a string value over `max_string_bytes`
    out_of_range    an integer outside its type's range
    bad_json        a jsonl line that is not JSON
    not_object      a jsonl line that is JSON but not an object
    empty_entry     an entry with no fields, or whose `d` has no non-blank line
    oversize_entry  an entry over `max_entry_bytes` (names and values): one dead letter, whose
                    `_raw` describes the entry instead of holding it

Fields (or JSON keys) that are not in the schema are ignored; the event still counts. JSON
lines may use the non-standard `NaN`, `Infinity` and `-Infinity` that Python's `json.dumps`
writes: in a double field they are `non_finite`, elsewhere as any other value.

Each chunk of entries is first decoded with vectorised Arrow casts. Only a chunk in which a cast
fails, or which Arrow might read differently from the event-by-event path, is decoded again
event by event, to find which events are bad and why; so a trickle of bad input costs little,
and nothing in a bad chunk is lost or blamed on its neighbours.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from sluice.source.ids import event_ids, parse_id
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
    ("_e", pa.int64()),
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
DECODE_REASONS: tuple[str, ...] = (
    "missing_field",
    "bad_type",
    "invalid_utf8",
    "non_finite",
    "too_long",
    "out_of_range",
    "bad_json",
    "not_object",
    "empty_entry",
    "oversize_entry",
)
_INT_RANGE = {"long": (-(2**63), 2**63 - 1), "int": (-(2**31), 2**31 - 1)}
# Blank lines, as `bytes.strip` sees them: only b" \t\r\x0b\x0c" between two newlines.
_BLANK_FIRST = re.compile(rb"[ \t\r\x0b\x0c]*(?:\n|\Z)")
_BLANK_AFTER_NL = re.compile(rb"\n[ \t\r\x0b\x0c]*(?:\n|\Z)")
# A line break not between `}` (or `}\r`) and `{`. The literal prefix keeps it fast.
_ODD_LINE_BREAK = re.compile(rb"\n(?:(?!\{)|(?<!\}\n)(?<!\}\r\n))")
# `Inf` or `-Inf` where a JSON value starts: after `:`, `,` or `[` and up to 3 whitespace
# bytes, or after 4 whitespace bytes (so a longer run is caught too). Arrow's reader takes
# these as infinity; orjson and Python's json refuse them. The literal prefix keeps it fast.
_VALUE_START = (
    rb"[:,\[]",
    rb"[:,\[][ \t\r]",
    rb"[:,\[][ \t\r]{2}",
    rb"[:,\[][ \t\r]{3}",
    rb"[ \t\r]{4}",
)
_ARROW_ONLY_INF = re.compile(
    rb"Inf(?!inity)(?:"
    + b"|".join(rb"(?<=" + v + sign + rb"Inf)" for v in _VALUE_START for sign in (b"", b"-"))
    + b")"
)


def entry_event_count(fields: dict[bytes, bytes], fmt: str, max_entry_bytes: int) -> int:
    """How many events (good or dead-lettered) one stream entry holds: the decoder yields
    exactly this many rows for it. The completeness audit replicates this rule in Lua, so any
    change here must be made there too.

    1. The entry's size is the sum of `len(name) + len(value)` over `fields`. Over
       `max_entry_bytes`: 1 (one `oversize_entry` dead letter).
    2. `fmt == "fields"`: 1.
    3. `fmt == "jsonl"` without a `d` field: 1 (`missing_field` on `d`, or `empty_entry` when
       the entry has no fields at all).
    4. `fmt == "jsonl"`: split `d` on b"\\n" only (a b"\\r" stays in its line) and keep the
       lines with a non-empty `line.strip()` (Python's bytes.strip: b" \\t\\n\\r\\x0b\\x0c").
       The count is the number of kept lines, or 1 when none is kept (`empty_entry`).

    An event's `_idx` is its 0-based position among the kept lines (0 in cases 1 to 3).
    `fields` is the entry's field map; with a repeated field name the last value wins (as in
    a Lua table filled in order), and only the surviving pairs count towards the size.
    """
    if fmt not in ("fields", "jsonl"):
        raise ValueError(f"unknown source format {fmt!r}; expected `fields` or `jsonl`")
    if _entry_bytes(fields) > max_entry_bytes or fmt == "fields":
        return 1
    payload = fields.get(b"d")
    if payload is None:
        return 1
    return max(1, len(_event_lines(payload)))


def _entry_bytes(fields: dict[bytes, bytes]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


def _event_lines(payload: bytes) -> list[bytes]:
    """The event lines of a jsonl payload, in order: its non-blank lines."""
    return [ln for ln in payload.split(b"\n") if ln.strip()]


def _has_blank_line(payload: bytes) -> bool:
    return _BLANK_FIRST.match(payload) is not None or _BLANK_AFTER_NL.search(payload) is not None


def _event_payload(payload: bytes) -> bytes:
    """The payload's event lines joined by b"\\n" (the payload itself when it has no blank
    line, which is checked without splitting it)."""
    if not _has_blank_line(payload):
        return payload
    return b"\n".join(_event_lines(payload))


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
        "_e": "bigint",
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
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate, which Python's json lets through
            raise _Bad("invalid_utf8", name) from None
        if size > max_bytes:
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


def _loads(line: bytes) -> Any:
    """One JSON line, or raise _Bad (`invalid_utf8` or `bad_json`).

    orjson first; when it refuses, Python's json, which also reads the `NaN`, `Infinity` and
    `-Infinity` that Arrow's reader accepts on the vectorised path, so that both paths agree.
    """
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("invalid_utf8") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise _Bad("bad_json") from None


def _oversize_raw(eid: Any, fields: dict[bytes, bytes], max_entry_bytes: int) -> str:
    """A short description of an oversize entry, for its dead letter (never the payload)."""
    entry_id = eid.decode("utf-8", "replace") if isinstance(eid, bytes) else str(eid)
    names = [_truncate(k[:64]) for k in list(fields)[:16]]
    more = ", …" if len(fields) > 16 else ""
    return _truncate(
        f"entry {entry_id} is {_entry_bytes(fields)} bytes, over max_entry_bytes"
        f" {max_entry_bytes}; fields: {', '.join(names)}{more}"
    )


class Decoder:
    """Turns raw entries into record batches. One per `read()` call; holds no connections."""

    def __init__(self, opts: SourceOptions, ref_ms: int, stream: str) -> None:
        self.opts = opts
        self.ref_ms = ref_ms
        self.stream = stream  # the shard read: part of every event id
        self.schema = output_schema(opts)
        self.names = [n for n, _, _ in opts.fields]
        self.bnames = [n.encode() for n in self.names]
        self.json_schema = pa.schema([(n, ARROW_TYPES[t]) for n, t, _ in opts.fields])

    def decode(self, entries: Sequence[Sequence[Any]]) -> Iterator[pa.RecordBatch]:
        """One record batch per chunk of entries, with `entry_event_count` rows per entry, in
        order. Never raises on bad input: bad events are rows with `_err` set."""
        for i in range(0, len(entries), CHUNK_ENTRIES):
            chunk = entries[i : i + CHUNK_ENTRIES]
            if self.opts.format == "jsonl":
                yield self._jsonl(chunk)
            else:
                yield self._fields(chunk)

    def _oversize(self, chunk: Sequence[Sequence[Any]], maps: list[dict[bytes, bytes]]) -> set[int]:
        """Indexes of the entries over `max_entry_bytes`. The sum over the raw field list is an
        upper bound of the map's (a repeated name counts once there), so it screens cheaply."""
        limit = self.opts.max_entry_bytes
        if sum(map(len, itertools.chain.from_iterable(e[1] for e in chunk))) <= limit:
            return set()
        return {
            k
            for k, e in enumerate(chunk)
            if sum(map(len, e[1])) > limit and _entry_bytes(maps[k]) > limit
        }

    def _raw_entry(
        self, chunk: Sequence[Sequence[Any]], maps: list[dict[bytes, bytes]], big: set[int], k: int
    ) -> str:
        """The dead-letter `_raw` of entry `k` as a whole."""
        if k in big:
            return _oversize_raw(chunk[k][0], maps[k], self.opts.max_entry_bytes)
        return orjson_fields(maps[k])

    # -- fields format: one event per entry -------------------------------------------------

    def _fields(self, chunk: Sequence[Sequence[Any]]) -> pa.RecordBatch:
        maps = [dict(zip(fl[0::2], fl[1::2], strict=False)) for _, fl in chunk]
        ems = [parse_id(e[0])[0] for e in chunk]
        counts = np.ones(len(chunk), dtype=np.int64)
        big = self._oversize(chunk, maps)

        def raw_of(i: int) -> str:
            return self._raw_entry(chunk, maps, big, i)

        cols = None if big else self._fast_fields(maps)
        if cols is not None:
            return self._finish(chunk, counts, ems, cols, None, raw_of)
        values: list[list[Any]] = [[] for _ in self.names]
        errs: list[tuple[str, str | None] | None] = []
        for k, m in enumerate(maps):
            row: list[Any] = []
            err: tuple[str, str | None] | None = None
            if k in big:
                err = ("oversize_entry", None)
            elif not m:
                err = ("empty_entry", None)
            for (name, typ, nullable), bname in zip(self.opts.fields, self.bnames, strict=True):
                raw = m.get(bname)
                if raw is None or err is not None:
                    # The first problem in schema order, as `_finish` flags it on the fast path.
                    if raw is None and err is None and not nullable:
                        err = ("missing_field", name)
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
        return self._finish(chunk, counts, ems, cols, errs, raw_of)

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
                elif typ in ("long", "int") and pc.any(_has_x(text)).as_py():
                    return None  # Arrow's cast reads hex, "0xFFFFFFFFFFFFFFFF" as -1; int() not
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
        big = self._oversize(chunk, maps)
        got = [m.get(b"d") for m in maps]
        if big or any(p is None for p in got):
            return self._jsonl_slow(chunk, maps, ems, big)
        payloads = cast(list[bytes], got)
        buf = b"\n".join(payloads)
        if not _object_lines(buf):
            # Blank lines (a trailing newline, say) are not events (see entry_event_count).
            payloads = [_event_payload(p) for p in payloads]
            buf = b"\n".join(payloads)
            if not all(payloads) or not _object_lines(buf):
                return self._jsonl_slow(chunk, maps, ems, big)
        counts = np.fromiter(
            (p.count(b"\n") + 1 for p in payloads), dtype=np.int64, count=len(payloads)
        )
        n = int(counts.sum())
        table = None if _arrow_only_number(buf) else self._read_json(buf)
        if table is None or table.num_rows != n:
            return self._jsonl_slow(chunk, maps, ems, big)
        cols = {name: table.column(name).combine_chunks() for name in self.names}
        lines: list[bytes] | None = None

        def raw_of(i: Any) -> str:
            nonlocal lines
            if lines is None:
                lines = buf.split(b"\n")
            return _truncate(lines[i])

        return self._finish(chunk, counts, ems, cols, None, raw_of)

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
        self,
        chunk: Sequence[Sequence[Any]],
        maps: list[dict[bytes, bytes]],
        ems: list[int],
        big: set[int],
    ) -> pa.RecordBatch:
        values: list[list[Any]] = [[] for _ in self.names]
        errs: list[tuple[str, str | None] | None] = []
        raws: list[str] = []
        counts = np.zeros(len(chunk), dtype=np.int64)
        for k, m in enumerate(maps):
            payload = None if k in big else m.get(b"d")
            lines = _event_lines(payload) if payload is not None else []
            if not lines:  # one dead letter for the whole entry
                if k in big:
                    errs.append(("oversize_entry", None))
                elif payload is None and m:
                    errs.append(("missing_field", "d"))
                else:
                    errs.append(("empty_entry", None))
                raws.append(self._raw_entry(chunk, maps, big, k))
                for col in values:
                    col.append(None)
                counts[k] = 1
                continue
            counts[k] = len(lines)
            for line in lines:
                row, err = self._json_line(line)
                for j, v in enumerate(row):
                    values[j].append(v)
                errs.append(err)
                raws.append(_truncate(line))
        cols = {
            n: pa.array(values[j], type=ARROW_TYPES[t])
            for j, (n, t, _) in enumerate(self.opts.fields)
        }
        return self._finish(chunk, counts, ems, cols, errs, lambda i: raws[i])

    def _json_line(self, line: bytes) -> tuple[list[Any], tuple[str, str | None] | None]:
        """One jsonl event: its schema values, and its error (None for a good event)."""
        row: list[Any] = [None] * len(self.names)
        try:
            obj = _loads(line)
        except _Bad as b:
            return row, (b.reason, b.field)
        if not isinstance(obj, dict):
            return row, ("not_object", None)
        for j, (name, typ, nullable) in enumerate(self.opts.fields):
            v = obj.get(name)
            if v is None:
                if not nullable:  # the first problem in schema order, as on the fast path
                    return [None] * len(self.names), ("missing_field", name)
                continue
            try:
                row[j] = _convert_json(v, typ, name, self.opts.max_string_bytes)
            except _Bad as b:
                return [None] * len(self.names), (b.reason, b.field)
        return row, None

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
            pa.array(self._event_ids(chunk, counts, idx, self.stream)),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    @staticmethod
    def _event_ids(
        chunk: Sequence[Sequence[Any]], counts: np.ndarray, idx: pa.Array, stream: str
    ) -> np.ndarray:
        parts = np.array([parse_id(e[0]) for e in chunk], dtype=np.uint64).reshape(-1, 2)
        return event_ids(
            np.repeat(parts[:, 0], counts).astype(np.int64),
            np.repeat(parts[:, 1], counts),
            idx.to_numpy(zero_copy_only=False),
            stream,
        )


def _has_x(text: pa.Array) -> pa.Array:
    return pc.match_substring(text, "x", ignore_case=True)


def _object_lines(buf: bytes) -> bool:
    """Whether every line of `buf` starts with `{` and ends with `}` (or `}\\r`); one regex pass.

    Only then is Arrow's reader used. No object can span two such lines (after a `}` inside an
    object or array a `{` is a syntax error, and Arrow refuses raw newlines in strings), so
    equal line and row counts mean one row per line. And Arrow never sees a line that is not
    an object: it reads a `null` line as a row, and crashes when every line is `null`.
    """
    return (
        buf[:1] == b"{"
        and (buf[-1:] == b"}" or buf[-2:] == b"}\r")
        and _ODD_LINE_BREAK.search(buf) is None
    )


def _arrow_only_number(buf: bytes) -> bool:
    """Whether `buf` may hold a number literal that Arrow's reader accepts and the
    event-by-event path refuses (`Inf`, `-Inf`, `-NaN`). One-byte searches first: they are
    memchr-fast, and most buffers have neither an `I` nor an `N`."""
    if b"N" in buf and b"-NaN" in buf:
        return True
    if b"I" in buf and b"Inf" in buf:
        return _ARROW_ONLY_INF.search(buf) is not None
    return False


def orjson_fields(m: dict[bytes, bytes]) -> str:
    """A readable JSON rendering of a `fields` entry, for the dead-letter record."""
    return _truncate(
        orjson.dumps(
            {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in m.items()}
        )
    )
