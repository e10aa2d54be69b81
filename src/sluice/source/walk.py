"""Walking a Redis stream's entries on the client: the planner's budget and the audit's source.

A batch's budget is counted entry by entry in plain XRANGE replies parsed by hiredis, which is
neither the columnar reader nor the decoder the batch itself reads with. So the XOR of the walked
entries' event ids is the audit's source side of the batch, computed independently of the
fold's read (`RedisStreamsLog.planned_source`), at no cost beyond the walk the budget needs.

Each entry's events are counted by `audit_event_count`, the decoder's rule written apart from
the decoder. Only the id columns, the counts and one XOR per entry are kept: the payloads are
dropped chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.collector import paused
from sluice.source.ids import entry_id_columns, event_ids, format_id, xor_all
from sluice.source.xrange import xrange_chunk

# Entries per XRANGE call of a walk: a `fields` entry is one small event; a `jsonl` entry holds
# hundreds of events and tens of KB, so fewer of them keep a reply's memory small.
WALK_CHUNK = {"fields": 10_000, "jsonl": 50}
# The bytes other than b"\n" that Python's bytes.strip removes: a line is blank when it holds
# nothing else.
_BLANK = b" \t\r\x0b\x0c"


def audit_event_count(fields: list[bytes], max_entry_bytes: int) -> int:
    """How many events one `jsonl` entry holds (its flat [name, value, ...] list), for the
    audit: the rule of `values.entry_event_count`, which the decoder uses, written apart from
    it so that the audit does not share the decoder's code. Over `max_entry_bytes` (names and
    values, the last value of a repeated name only): 1. No `d`: 1. Else the lines of `d` (split
    on b"\\n") that hold a byte other than whitespace, or 1 when none does."""
    last = dict(zip(fields[0::2], fields[1::2], strict=True))
    if (
        sum(map(len, fields)) > max_entry_bytes
        and sum(len(k) + len(v) for k, v in last.items()) > max_entry_bytes
    ):
        return 1
    d = last.get(b"d")
    if d is None:
        return 1
    kept = d.translate(None, _BLANK)  # a blank line is now an empty one
    if kept and b"\n\n" not in kept and kept[0] != 10 and kept[-1] != 10:
        return kept.count(b"\n") + 1  # no empty line: every line counts
    return max(1, sum(1 for line in kept.split(b"\n") if line))


@dataclass(frozen=True)
class Walked:
    """Entries of one shard in stream order: their id columns (`ms`, `seq`), events per entry
    (`events`) and the XOR of each entry's event ids (`xors`)."""

    ms: Any
    seq: Any
    events: Any
    xors: Any

    @classmethod
    def of(cls, chunk: list[Any], shard: str, fmt: str, max_entry_bytes: int) -> Walked:
        """The entries of a raw XRANGE chunk: one event each for `fields`, `audit_event_count`
        for `jsonl`."""
        ms, seq = entry_id_columns([e[0] for e in chunk])
        ms = ms.astype(np.int64)
        if fmt == "fields":
            ones = np.ones(len(chunk), np.int64)
            return cls(ms, seq, ones, event_ids(ms, seq, np.zeros(len(chunk)), shard))
        events = np.fromiter(
            (audit_event_count(e[1], max_entry_bytes) for e in chunk),
            dtype=np.int64, count=len(chunk),
        )  # fmt: skip
        starts = np.cumsum(events) - events
        idx = np.arange(int(events.sum()), dtype=np.int64) - np.repeat(starts, events)
        ids = event_ids(np.repeat(ms, events), np.repeat(seq, events), idx, shard)
        return cls(ms, seq, events, np.bitwise_xor.reduceat(ids, starts))

    @classmethod
    def none(cls) -> Walked:
        empty = np.zeros(0, np.int64)
        return cls(empty, empty.astype(np.uint64), empty, empty)

    def __len__(self) -> int:
        return len(self.ms)

    @property
    def total(self) -> int:
        return int(self.events.sum())

    def xor(self) -> int:
        return xor_all(self.xors)

    def last_id(self) -> str:
        return format_id(int(self.ms[-1]), int(self.seq[-1]))

    def fitting(self, budget: int, force_first: bool) -> int:
        """How many leading entries fit in `budget` events; with `force_first`, at least one
        (so that an entry larger than the budget cannot stall its shard)."""
        k = int(np.searchsorted(np.cumsum(self.events), budget, side="right"))
        return max(k, 1) if force_first and len(self) else k

    def split(self, k: int) -> tuple[Walked, Walked]:
        """(the first `k` entries, the rest)."""
        head = Walked(self.ms[:k], self.seq[:k], self.events[:k], self.xors[:k])
        return head, Walked(self.ms[k:], self.seq[k:], self.events[k:], self.xors[k:])

    @staticmethod
    def join(parts: list[Walked]) -> Walked:
        if not parts:
            return Walked.none()
        if len(parts) == 1:
            return parts[0]
        names = ("ms", "seq", "events", "xors")
        cols = [np.concatenate([getattr(p, c) for p in parts]) for c in names]
        return Walked(*cols)


def read_entries(
    client: Any, shard: str, after: str, events: int, fmt: str, max_entry_bytes: int
) -> Walked:
    """The entries of `shard` after `after`, chunk by chunk, until they hold at least `events`
    events or the stream ends. A `jsonl` chunk asks for about as many entries as are still
    wanted, by the events per entry seen so far."""
    parts: list[Walked] = []
    got = n_entries = 0
    cursor = after
    while got < events:
        per_entry = max(1, got // n_entries) if n_entries else 1
        want = min(WALK_CHUNK[fmt], -(-(events - got) // per_entry))
        with paused():  # until the chunk's lists are freed (see `sluice.collector`)
            chunk = xrange_chunk(client, shard, cursor, "+", want)
            part = Walked.of(chunk, shard, fmt, max_entry_bytes) if chunk else Walked.none()
            del chunk
        if not len(part):
            break
        parts.append(part)
        got += part.total
        n_entries += len(part)
        cursor = part.last_id()
        if len(part) < want:  # the end of the stream
            break
    return Walked.join(parts)


def walk(
    client: Any,
    shard: str,
    after: str,
    budget: int,
    force_first: bool,
    fmt: str,
    max_entry_bytes: int,
    read: Walked | None = None,
) -> tuple[Walked, Walked]:
    """(taken, rest): the entries of `shard` after `after` that fit in `budget` events (with
    `force_first`, at least the first one), and the entries read after them, which hold at least
    the next one when more wait and none at the stream's end. `read`: entries already read
    after `after` (in stream order, none left out), taken before any are read anew."""
    parts: list[Walked] = []
    taken = 0
    rest = read if read is not None else Walked.none()
    while True:
        if not len(rest):  # all read so far is taken: read on from the last one
            cursor = parts[-1].last_id() if parts else after
            wanted = max(1, budget - taken)  # at least the next entry, to tell whether more wait
            rest = read_entries(client, shard, cursor, wanted, fmt, max_entry_bytes)
            if not len(rest):
                return Walked.join(parts), rest
        k = rest.fitting(budget - taken, force_first and not parts)
        head, rest = rest.split(k)
        if k:
            parts.append(head)
            taken += head.total
        if len(rest):  # the next entry did not fit
            return Walked.join(parts), rest
