"""Value-level rules of the decoder: how many events an entry holds, how one value converts to
its declared type, and the checks that keep Arrow's vectorised reader in step with the
event-by-event path. Pure functions of bytes; `source.decode` assembles them into batches.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from sluice.source.options import SourceOptions

ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "long": pa.int64(),
    "int": pa.int32(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
}
SPARK_TYPES = {
    "string": "string",
    "long": "bigint",
    "int": "int",
    "double": "double",
    "float": "float",
    "boolean": "boolean",
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
RAW_LIMIT = 1024
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
    "null_value",
    "lost_records",
)
INT_RANGE = {"long": (-(2**63), 2**63 - 1), "int": (-(2**31), 2**31 - 1)}
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
    exactly this many rows for it. The planner and the audit count it with their own code
    (`source.walk.audit_event_count`), so any change here must be made there too.

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
    if entry_bytes(fields) > max_entry_bytes or fmt == "fields":
        return 1
    payload = fields.get(b"d")
    if payload is None:
        return 1
    return max(1, len(event_lines(payload)))


def record_payload(value: bytes | None, fmt: str) -> bytes | None:
    """The jsonl payload of one Kafka record value (None stays None: a tombstone).

    `json`: the value is one JSON document, which may span lines; JSON allows a line break only
    where it allows a space, so turning line breaks into spaces keeps a valid document valid
    and one event, and an invalid one one `bad_json` event. `jsonl`: the value as it is.
    """
    if value is None or fmt == "jsonl":
        return value
    return value.replace(b"\n", b" ") if b"\n" in value else value


def record_event_count(value: bytes | None, fmt: str, max_entry_bytes: int) -> int:
    """How many events (good or dead-lettered) one Kafka record holds, by the rule of
    `entry_event_count`: 1 for a null value (`null_value`), for a value over
    `max_entry_bytes` (`oversize_entry`) and in `json`; in `jsonl` its non-blank lines, or 1
    when it has none (`empty_entry`)."""
    if fmt not in ("json", "jsonl"):
        raise ValueError(f"unknown Kafka format {fmt!r}; expected `json` or `jsonl`")
    if value is None or len(value) > max_entry_bytes or fmt == "json":
        return 1
    return max(1, len(event_lines(value)))


def entry_bytes(fields: dict[bytes, bytes]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


def event_lines(payload: bytes) -> list[bytes]:
    """The event lines of a jsonl payload, in order: its non-blank lines."""
    return [ln for ln in payload.split(b"\n") if ln.strip()]


def has_blank_line(payload: bytes) -> bool:
    return _BLANK_FIRST.match(payload) is not None or _BLANK_AFTER_NL.search(payload) is not None


def event_payload(payload: bytes) -> bytes:
    """The payload's event lines joined by b"\\n" (the payload itself when it has no blank
    line, which is checked without splitting it)."""
    if not has_blank_line(payload):
        return payload
    return b"\n".join(event_lines(payload))


class Bad(Exception):
    def __init__(self, reason: str, field: str | None = None) -> None:
        self.reason = reason
        self.field = field


def truncate(raw: bytes | str) -> str:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return text if len(text) <= RAW_LIMIT else text[:RAW_LIMIT] + "…"


def convert_text(value: bytes, typ: str, name: str, max_bytes: int) -> Any:
    """Convert one `fields`-format value (bytes) to its Python value, or raise Bad."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise Bad("invalid_utf8", name) from None
    if typ == "string":
        if len(value) > max_bytes:
            raise Bad("too_long", name)
        return text
    if typ != "boolean" and ("_" in text or not text.isascii()):
        raise Bad("bad_type", name)  # Python reads 1_000 and other scripts' digits; no one else
    if typ in ("long", "int"):
        try:
            v = int(text.strip())
        except ValueError:
            raise Bad("bad_type", name) from None
        lo, hi = INT_RANGE[typ]
        if not lo <= v <= hi:
            raise Bad("out_of_range", name)
        return v
    if typ in ("double", "float"):
        try:
            f = float(text)
        except ValueError:
            raise Bad("bad_type", name) from None
        if not math.isfinite(f):
            raise Bad("non_finite", name)
        return f
    low = text.strip().lower()
    if low in ("true", "1"):
        return True
    if low in ("false", "0"):
        return False
    raise Bad("bad_type", name)


def convert_json(value: Any, typ: str, name: str, max_bytes: int) -> Any:
    """Check one decoded JSON value against its declared type, or raise Bad."""
    if typ == "string":
        if not isinstance(value, str):
            raise Bad("bad_type", name)
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate, which Python's json lets through
            raise Bad("invalid_utf8", name) from None
        if size > max_bytes:
            raise Bad("too_long", name)
        return value
    if typ in ("long", "int"):
        lo, hi = INT_RANGE[typ]
        # An integer past 64 bits, which the JSON parser reads as a double (one just below
        # -2**63 rounds to -2**63.0, inside the range as a double).
        past = isinstance(value, float) and value.is_integer()
        if past and (abs(value) >= 2.0**63 or not lo <= value <= hi):
            raise Bad("out_of_range", name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise Bad("bad_type", name)
        if not lo <= value <= hi:
            raise Bad("out_of_range", name)
        return value
    if typ in ("double", "float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Bad("bad_type", name)
        f = float(value)
        if not math.isfinite(f):
            raise Bad("non_finite", name)
        return f
    if not isinstance(value, bool):
        raise Bad("bad_type", name)
    return value


def loads_json(line: bytes) -> Any:
    """One JSON line, or raise Bad (`invalid_utf8` or `bad_json`).

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
        raise Bad("invalid_utf8") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise Bad("bad_json") from None


def oversize_raw(eid: Any, fields: dict[bytes, bytes], max_entry_bytes: int) -> str:
    """A short description of an oversize entry, for its dead letter (never the payload)."""
    entry_id = eid.decode("utf-8", "replace") if isinstance(eid, bytes) else str(eid)
    names = [truncate(k[:64]) for k in list(fields)[:16]]
    more = ", …" if len(fields) > 16 else ""
    return truncate(
        f"entry {entry_id} is {entry_bytes(fields)} bytes, over max_entry_bytes"
        f" {max_entry_bytes}; fields: {', '.join(names)}{more}"
    )


def has_x(text: pa.Array) -> pa.Array:
    return pc.match_substring(text, "x", ignore_case=True)


def object_lines(buf: bytes) -> bool:
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


def arrow_only_number(buf: bytes) -> bool:
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
    return truncate(
        orjson.dumps(
            {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in m.items()}
        )
    )


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
