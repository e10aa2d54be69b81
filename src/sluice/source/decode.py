"""Decode raw log entries into Arrow record batches, and flag bad events instead of failing.

Input is a chunk of log entries: what XRANGE returns without client-side parsing,
`[[id, [f1, v1, f2, v2, ...]], ...]` with every element as bytes (`decode`), or the values,
offsets and timestamps of Kafka records (`decode_records`). Output columns are the schema
fields followed by:

    _ts   long    event time in ms (the time field, or the entry's log time when it is missing)
    _ems  long    the entry's log time (when Redis accepted it; a Kafka record's timestamp)
    _ref  long    the batch's reference time, fixed when the batch was planned
    _err  string  null for a good event, else the dead-letter reason
    _field string the offending field, when there is one
    _eid  string  the entry's name in the log, for bad events and those the fold will find
                  out of time (`SourceOptions.named_ahead_ms`): a stream entry id, or
                  `<topic>:<partition>@<offset>` for a Kafka record
    _idx  int     the event's index within its entry
    _raw  string  the offending input, truncated, for bad events only
    _e    long    the event's 64-bit id (see source.ids.event_ids): from the shard, the entry's
                  position (a stream entry id; a Kafka offset) and `_idx`

How many events an entry holds is `values.entry_event_count` (Kafka: `record_event_count`),
one rule also applied by the completeness audit: one per `fields` or `json` entry, one per
non-blank line of a `jsonl` payload, and one dead letter for an entry that is empty, has no
`d`, has only blank lines, is over `max_entry_bytes` or is a null Kafka record. A bad event
never takes its neighbours down with it.

The dead-letter reasons (`_err`) the decoder sets are `DECODE_REASONS`:

    missing_field   a non-nullable field is absent or null (`_field` names it; `d` in jsonl)
    bad_type        a value of the wrong type, or text that does not parse as its type
    invalid_utf8    bytes that are not UTF-8 (or a JSON string with a lone surrogate)
    non_finite      NaN or ±infinity in a double or float field
    too_long        a string value over `max_string_bytes`
    out_of_range    an integer outside its type's range
    bad_json        a JSON line (a Kafka `json` value) that is not JSON
    not_object      a JSON line that is JSON but not an object
    empty_entry     an entry with no fields, or whose payload has no non-blank line
    oversize_entry  an entry over `max_entry_bytes` (a stream entry's names and values; a Kafka
                    record's value): one dead letter, whose `_raw` describes the entry
    null_value      a Kafka record with a null value (a tombstone)
    lost_records    Kafka records deleted by the broker before they were read (one dead
                    letter for the run of offsets; see `Decoder.lost`)

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from sluice.source.columns import EntryIds, reply_entry_ids, stream_entry_ids, typed_columns
from sluice.source.ids import event_ids
from sluice.source.options import SourceOptions
from sluice.source.resp import StreamReply
from sluice.source.values import (
    ARROW_TYPES,
    DECODE_REASONS,
    META_FIELDS,
    RAW_LIMIT,
    Bad,
    arrow_only_number,
    convert_json,
    convert_text,
    entry_bytes,
    entry_event_count,
    event_lines,
    event_payload,
    loads_json,
    object_lines,
    orjson_fields,
    output_schema,
    oversize_raw,
    record_payload,
    spark_schema_ddl,
    truncate,
)

__all__ = [
    "CHUNK_ENTRIES",
    "DECODE_REASONS",
    "META_FIELDS",
    "RAW_LIMIT",
    "Decoder",
    "entry_event_count",
    "output_schema",
    "spark_schema_ddl",
]

CHUNK_ENTRIES = 4096
Err = tuple[str, str | None]


class Decoder:
    """Turns raw entries into record batches. One per `read()` call; holds no connections.

    `stream` is the shard's name in event ids: the stream key, or `<topic>:<partition>`. Where
    a source has several streams, an entry's name (`_eid`) is `<stream>@<entry id>`.
    """

    def __init__(self, opts: SourceOptions, ref_ms: int, stream: str) -> None:
        self.opts, self.ref_ms, self.stream = opts, ref_ms, stream
        self.entry_prefix = f"{stream}@" if len(opts.shards) > 1 else ""
        self.schema = output_schema(opts)
        self.names = [n for n, _, _ in opts.fields]
        self.bnames = [n.encode() for n in self.names]
        self.json_schema = pa.schema([(n, ARROW_TYPES[t]) for n, t, _ in opts.fields])

    def decode(self, entries: Sequence[Sequence[Any]]) -> Iterator[pa.RecordBatch]:
        """Stream entries: one record batch per chunk, with `entry_event_count` rows per entry,
        in order. Never raises on bad input: bad events are rows with `_err` set."""
        for i in range(0, len(entries), CHUNK_ENTRIES):
            chunk = entries[i : i + CHUNK_ENTRIES]
            if self.opts.format == "jsonl":
                yield self._jsonl_entries(chunk)
            else:
                yield self._fields(chunk)

    def decode_reply(self, reply: StreamReply) -> Iterator[pa.RecordBatch]:
        """A columnar XRANGE reply (`source.resp`), with the rows `decode` would give for its
        entries. `fields` entries go straight from the reply's bytes to Arrow when the whole
        reply is clean (no entry empty or over `max_entry_bytes`, every cast good); anything
        else is decoded by `decode`, chunk by chunk, from the entries as Python objects."""
        if self.opts.format == "fields" and len(reply):
            batch = self._fields_reply(reply)
            if batch is not None:
                yield batch
                return
        yield from self.decode(reply.entries())

    def decode_records(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int],
        timestamps: Sequence[int],
        topic: str,
        partition: int,
    ) -> Iterator[pa.RecordBatch]:
        """Kafka records of one partition (`json` or `jsonl`): one record batch per chunk,
        `values.record_event_count` rows per record, in order. Never raises on bad input."""
        limit = self.opts.max_entry_bytes
        for i in range(0, len(values), CHUNK_ENTRIES):
            vals = values[i : i + CHUNK_ENTRIES]
            offs = np.asarray(offsets[i : i + CHUNK_ENTRIES], dtype=np.int64)

            def name(k: int, offs: np.ndarray = offs) -> str:
                return f"{topic}:{partition}@{int(offs[k])}"

            ids = EntryIds(
                offs.astype(np.uint64),
                np.zeros(len(offs), dtype=np.uint64),
                np.asarray(timestamps[i : i + CHUNK_ENTRIES], dtype=np.int64),
                name,
            )
            whole: dict[int, Err] = {}
            for k, v in enumerate(vals):
                if v is None:
                    whole[k] = ("null_value", None)
                elif len(v) > limit:
                    whole[k] = ("oversize_entry", None)

            def raw_entry(k: int, vals: Sequence[bytes | None] = vals, ids: EntryIds = ids) -> str:
                v = vals[k]
                if v is None:
                    return f"record {ids.name(k)} has a null value (a tombstone)"
                if len(v) > limit:
                    return f"record {ids.name(k)} is {len(v)} bytes, over max_entry_bytes {limit}"
                return truncate(v)

            payloads = [None if k in whole else record_payload(v, self.opts.format)
                        for k, v in enumerate(vals)]  # fmt: skip
            yield self._jsonl(ids, payloads, whole, raw_entry)

    def lost(self, run: tuple[int, int], topic: str, partition: int) -> pa.RecordBatch:
        """One dead letter (`lost_records`) for the offsets [run[0], run[1]) of a Kafka
        partition that the broker deleted before they were read: the records are gone, and
        this row says so (the audit counts it as one event at offset run[0])."""
        lo, hi = run
        ids = EntryIds(
            np.array([lo], dtype=np.uint64),
            np.zeros(1, dtype=np.uint64),
            np.array([self.ref_ms], dtype=np.int64),
            lambda k: f"{topic}:{partition}@{lo}",
        )
        cols = {n: pa.nulls(1, ARROW_TYPES[t]) for n, t, _ in self.opts.fields}
        raw = (
            f"records {lo}..{hi - 1} of {topic}:{partition} were deleted (retention or"
            " truncation) before they were read"
        )
        return self._finish(ids, np.ones(1, dtype=np.int64), cols, [("lost_records", None)],
                            lambda i: raw)  # fmt: skip

    def _oversize(self, chunk: Sequence[Sequence[Any]], maps: list[dict[bytes, bytes]]) -> set[int]:
        """Indexes of the entries over `max_entry_bytes`. The sum over the raw field list is an
        upper bound of the map's (a repeated name counts once there), so it screens cheaply."""
        limit = self.opts.max_entry_bytes
        if sum(map(len, itertools.chain.from_iterable(e[1] for e in chunk))) <= limit:
            return set()
        return {
            k
            for k, e in enumerate(chunk)
            if sum(map(len, e[1])) > limit and entry_bytes(maps[k]) > limit
        }

    def _raw_entry(
        self, chunk: Sequence[Sequence[Any]], maps: list[dict[bytes, bytes]], big: set[int], k: int
    ) -> str:
        """The dead-letter `_raw` of stream entry `k` as a whole."""
        if k in big:
            return oversize_raw(chunk[k][0], maps[k], self.opts.max_entry_bytes)
        return orjson_fields(maps[k])

    # -- fields format: one event per entry -------------------------------------------------

    def _fields(self, chunk: Sequence[Sequence[Any]]) -> pa.RecordBatch:
        maps = [dict(zip(fl[0::2], fl[1::2], strict=False)) for _, fl in chunk]
        ids = stream_entry_ids(chunk, self.entry_prefix)
        counts = np.ones(len(chunk), dtype=np.int64)
        big = self._oversize(chunk, maps)

        def raw_of(i: int) -> str:
            return self._raw_entry(chunk, maps, big, i)

        cols = None if big else self._fast_fields(maps)
        if cols is not None:
            return self._finish(ids, counts, cols, None, raw_of)
        values: list[list[Any]] = [[] for _ in self.names]
        errs: list[Err | None] = []
        for k, m in enumerate(maps):
            row: list[Any] = []
            err: Err | None = None
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
                    row.append(convert_text(raw, typ, name, self.opts.max_string_bytes))
                except Bad as b:
                    err = (b.reason, b.field)
                    row.append(None)
            for j, v in enumerate(row):
                values[j].append(v)
            errs.append(err)
        cols = self._columns(values)
        return self._finish(ids, counts, cols, errs, raw_of)

    def _columns(self, values: list[list[Any]]) -> dict[str, pa.Array]:
        """The schema's columns from per-field lists of Python values (the slow paths)."""
        return {
            n: pa.array(values[j], type=ARROW_TYPES[t])
            for j, (n, t, _) in enumerate(self.opts.fields)
        }

    def _fast_fields(self, maps: list[dict[bytes, bytes]]) -> dict[str, pa.Array] | None:
        if any(not m for m in maps):
            return None
        return typed_columns(
            self.opts.fields, lambda name: pa.array([m.get(name) for m in maps], type=pa.binary())
        )

    def _fields_reply(self, reply: StreamReply) -> pa.RecordBatch | None:
        """`fields` entries of a columnar reply, or None when `_fields` must decide."""
        if (reply.n_pairs == 0).any() or (reply.pair_bytes() > self.opts.max_entry_bytes).any():
            return None  # empty or (perhaps) oversize entries: the event-by-event path says
        cols = typed_columns(self.opts.fields, reply.values)
        if cols is None:
            return None

        def raw_of(k: int) -> str:
            fl = reply.entries(k, k + 1)[0][1]
            return orjson_fields(dict(zip(fl[0::2], fl[1::2], strict=False)))

        counts = np.ones(len(reply), dtype=np.int64)
        return self._finish(reply_entry_ids(reply, self.entry_prefix), counts, cols, None, raw_of)

    # -- jsonl: many events per entry, newline-separated JSON objects ----------------------

    def _jsonl_entries(self, chunk: Sequence[Sequence[Any]]) -> pa.RecordBatch:
        """Stream entries in `jsonl`: the payload is field `d`."""
        maps = [dict(zip(fl[0::2], fl[1::2], strict=False)) for _, fl in chunk]
        big = self._oversize(chunk, maps)
        whole: dict[int, Err] = {}
        payloads: list[bytes | None] = []
        for k, m in enumerate(maps):
            payload = None if k in big else m.get(b"d")
            if k in big:
                whole[k] = ("oversize_entry", None)
            elif payload is None:
                whole[k] = ("missing_field", "d") if m else ("empty_entry", None)
            payloads.append(payload)

        def raw_entry(k: int) -> str:
            return self._raw_entry(chunk, maps, big, k)

        return self._jsonl(stream_entry_ids(chunk, self.entry_prefix), payloads, whole, raw_entry)

    def _jsonl(
        self,
        ids: EntryIds,
        payloads: list[bytes | None],
        whole: dict[int, Err],
        raw_entry: Callable[[int], str],
    ) -> pa.RecordBatch:
        """Decode jsonl payloads. `whole`: entries that are one dead letter as a whole (their
        payload is None); `raw_entry(k)` describes entry k for such a dead letter."""
        if whole:
            return self._jsonl_slow(ids, payloads, whole, raw_entry)
        given = cast(list[bytes], payloads)
        buf = b"\n".join(given)
        if not object_lines(buf):
            # Blank lines (a trailing newline, say) are not events (see entry_event_count).
            given = [event_payload(p) for p in given]
            buf = b"\n".join(given)
            if not all(given) or not object_lines(buf):
                return self._jsonl_slow(ids, payloads, whole, raw_entry)
        counts = np.fromiter((p.count(b"\n") + 1 for p in given), dtype=np.int64, count=len(given))
        n = int(counts.sum())
        table = None if arrow_only_number(buf) else self._read_json(buf)
        if table is None or table.num_rows != n:
            return self._jsonl_slow(ids, payloads, whole, raw_entry)
        cols = {name: table.column(name).combine_chunks() for name in self.names}
        lines: list[bytes] | None = None

        def raw_of(i: Any) -> str:
            nonlocal lines
            if lines is None:
                lines = buf.split(b"\n")
            return truncate(lines[i])

        return self._finish(ids, counts, cols, None, raw_of)

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
        ids: EntryIds,
        payloads: list[bytes | None],
        whole: dict[int, Err],
        raw_entry: Callable[[int], str],
    ) -> pa.RecordBatch:
        values: list[list[Any]] = [[] for _ in self.names]
        errs: list[Err | None] = []
        raws: list[str] = []
        counts = np.zeros(len(payloads), dtype=np.int64)
        for k, payload in enumerate(payloads):
            lines = event_lines(payload) if payload is not None else []
            if not lines:  # one dead letter for the whole entry
                errs.append(whole.get(k, ("empty_entry", None)))
                raws.append(raw_entry(k))
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
                raws.append(truncate(line))
        cols = self._columns(values)
        return self._finish(ids, counts, cols, errs, lambda i: raws[i])

    def _json_line(self, line: bytes) -> tuple[list[Any], Err | None]:
        """One jsonl event: its schema values, and its error (None for a good event)."""
        row: list[Any] = [None] * len(self.names)
        try:
            obj = loads_json(line)
        except Bad as b:
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
                row[j] = convert_json(v, typ, name, self.opts.max_string_bytes)
            except Bad as b:
                return [None] * len(self.names), (b.reason, b.field)
        return row, None

    # -- shared tail: validation, meta columns ----------------------------------------------

    def _out_of_time(self, ts: pa.Array) -> np.ndarray:
        """Which events the fold will dead-letter as `future`, or may as `expired`, by their
        time `ts` and the batch's (`SourceOptions.named_ahead_ms`, `named_behind_ms`)."""
        at = pc.fill_null(ts, self.ref_ms).to_numpy(zero_copy_only=False)
        out = np.zeros(len(at), dtype=bool)
        if self.opts.named_ahead_ms is not None:
            out |= at > self.ref_ms + self.opts.named_ahead_ms
        if self.opts.named_behind_ms is not None:
            out |= at < self.ref_ms - self.opts.named_behind_ms
        return out

    def _finish(
        self,
        ids: EntryIds,
        counts: np.ndarray,
        cols: dict[str, pa.Array],
        errs: list[Err | None] | None,
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

        ems = pa.array(np.repeat(ids.ems, counts))
        starts = np.cumsum(counts) - counts
        idx = pa.array((np.arange(n, dtype=np.int64) - np.repeat(starts, counts)).astype(np.int32))
        if self.opts.time_field is not None:
            ts = pc.coalesce(pc.cast(cols[self.opts.time_field], pa.int64()), ems)
        else:
            ts = ems
        flagged = err != None  # noqa: E711
        bad = np.flatnonzero(flagged)
        named = np.flatnonzero(flagged | self._out_of_time(ts))
        eid = np.full(n, None, dtype=object)
        raw = np.full(n, None, dtype=object)
        if len(named):
            entry_of = np.repeat(np.arange(len(counts)), counts)
            for row in named.tolist():
                eid[row] = ids.name(int(entry_of[row]))
            for row in bad.tolist():
                raw[row] = raw_of(row)
        e = event_ids(
            np.repeat(ids.hi, counts).astype(np.int64),
            np.repeat(ids.lo, counts),
            idx.to_numpy(zero_copy_only=False),
            self.stream,
        )
        arrays = [cols[name] for name in self.names] + [
            ts,
            ems,
            pa.array(np.full(n, self.ref_ms, dtype=np.int64)),
            pa.array(err, type=pa.string()),
            pa.array(field, type=pa.string()),
            pa.array(eid, type=pa.string()),
            idx,
            pa.array(raw, type=pa.string()),
            pa.array(e),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)
