"""The decoder's vectorised `fields` path: binary columns in, typed Arrow columns out, and the
entry ids of a chunk.

A `fields` chunk reaches `typed_columns` as one binary column per schema field (null where an
entry lacks the field), made either from per-entry dicts (entries parsed by hiredis) or straight
from the reply's bytes (`source.resp.StreamReply.values`, no Python object per field). Either
way the same Arrow casts run on them, so both give the same rows; a cast that fails, or that
Arrow would read differently from the event-by-event path, returns None and the caller decodes
the chunk event by event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sluice.source.ids import parse_id
from sluice.source.resp import StreamReply
from sluice.source.values import ARROW_TYPES, has_x


class EntryIds(NamedTuple):
    """Per entry of a chunk: the two halves of its position (for event ids), its log time, and
    its name for dead letters (asked only for entries that have one)."""

    hi: np.ndarray  # uint64: a stream entry id's ms; a Kafka offset
    lo: np.ndarray  # uint64: a stream entry id's sequence; 0 for Kafka
    ems: np.ndarray  # int64
    name: Callable[[int], str]


def stream_entry_ids(chunk: Sequence[Sequence[Any]], prefix: str = "") -> EntryIds:
    """The ids of XRANGE entries parsed by hiredis (`[[id, [f1, v1, ...]], ...]`); each
    entry's name is its id after `prefix`."""
    parts = np.array([parse_id(e[0]) for e in chunk], dtype=np.uint64).reshape(-1, 2)

    def name(k: int) -> str:
        eid = chunk[k][0]
        return prefix + (eid.decode() if isinstance(eid, bytes) else str(eid))

    return EntryIds(parts[:, 0], parts[:, 1], parts[:, 0].astype(np.int64), name)


def reply_entry_ids(reply: StreamReply, prefix: str = "") -> EntryIds:
    """The ids of the entries of a columnar XRANGE reply; names as `stream_entry_ids`'."""
    return EntryIds(
        reply.ms, reply.seq, reply.ms.astype(np.int64),
        lambda k: prefix + reply.entry_id(k).decode(),
    )  # fmt: skip


def typed_columns(
    fields: Sequence[tuple[str, str, bool]],
    column: Callable[[bytes], pa.Array],
) -> dict[str, pa.Array] | None:
    """Each schema field (name, type, nullable) cast from its binary column `column(name)`, or
    None when a cast fails or Arrow would read a value differently from `convert_text`."""
    cols: dict[str, pa.Array] = {}
    try:
        for name, typ, _ in fields:
            text = pc.cast(column(name.encode()), pa.string())
            if typ == "string":
                cols[name] = text
            elif typ == "boolean":
                cols[name] = pc.cast(pc.utf8_lower(pc.utf8_trim_whitespace(text)), pa.bool_())
            elif typ in ("long", "int") and pc.any(has_x(text)).as_py():
                return None  # Arrow's cast reads hex, "0xFFFFFFFFFFFFFFFF" as -1; int() not
            else:
                cols[name] = pc.cast(text, ARROW_TYPES[typ])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
        return None
    return cols
