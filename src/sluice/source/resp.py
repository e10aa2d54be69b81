"""A columnar reader of XRANGE replies: RESP2 bytes in, entry ids and field values out as numpy
and Arrow arrays, without a Python object per entry or per field.

An XRANGE reply is `*N` then, per entry, `*2`, `$<len>` and the id, `*<2F>` and F pairs of bulk
strings (name, value). `parse_xrange` finds every element with a few vectorised passes over the
bytes, cut into lines at each CRLF (see `_elements`). A name or value that itself holds a CRLF
spans two lines; the length check sees it, and `parse_xrange` returns None: the caller then
parses the reply the usual way (hiredis). Anything else that is not the shape of an XRANGE
reply (an error reply, RESP3) also gives None; nothing here raises on bad bytes.

`StreamReply` keeps the reply's bytes and, per element, where its data starts and how long it
is. `values(name)` gathers one field's values into a contiguous Arrow binary array (one copy of
their bytes, the last value winning when an entry repeats a name, as a dict would), so that the
decoder's Arrow casts run on it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

_STAR, _DOLLAR, _DASH = 42, 36, 45
_MAX_DIGITS = 10  # a bulk string is at most 512 MB: 9 digits


def _gather(b: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The bytes b[starts[i] : starts[i] + lens[i]] of every i, concatenated."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.uint8)
    out_at = np.cumsum(lens) - lens
    src = np.repeat(starts - out_at, lens) + np.arange(total, dtype=np.int64)
    return b[src]


def _digits(
    b: np.ndarray, starts: np.ndarray, lens: np.ndarray, max_len: int, skip_first: bool = False
) -> tuple[Any, Any]:
    """The decimal numbers written at b[starts : starts + lens] (unsigned, `lens` <= max_len),
    as uint64, and whether each was all digits (and 1 to `max_len` of them). `skip_first`:
    leave the first number 0 (and unchecked)."""
    ok = (lens >= 1) & (lens <= max_len)
    value = np.zeros(len(starts), dtype=np.uint64)
    if skip_first and len(starts):
        ok[0] = True
        lens = lens.copy()
        lens[0] = 0
    if not len(starts) or not ok.all():
        return value, ok
    ends = starts + lens
    with np.errstate(over="ignore"):  # up to 20 digits: uint64 wraps only past 2**64 - 1
        for j in range(int(lens.max())):
            has = lens > j
            d = b[np.where(has, ends - (j + 1), 0)] - np.uint8(48)  # a non-digit wraps past 9
            ok &= ~has | (d <= 9)
            value += np.where(has, d, 0).astype(np.uint64) * np.uint64(10**j)
    return value, ok


@dataclass(frozen=True)
class StreamReply:
    """A parsed XRANGE reply. Per entry: `ms` and `seq` (uint64), where its id's text starts and
    how long it is, and its field pairs. Per pair, in reply order: its entry, and where its name
    and its value start and how long they are. All offsets index `buf`."""

    buf: np.ndarray  # uint8, the reply's bytes
    ms: np.ndarray
    seq: np.ndarray
    id_start: np.ndarray
    id_len: np.ndarray
    n_pairs: np.ndarray
    pair_entry: np.ndarray
    name_start: np.ndarray
    name_len: np.ndarray
    value_start: np.ndarray
    value_len: np.ndarray

    def __len__(self) -> int:
        return len(self.ms)

    def entry_id(self, k: int) -> bytes:
        s = int(self.id_start[k])
        return self.buf[s : s + int(self.id_len[k])].tobytes()

    def last_id(self) -> bytes | None:
        return self.entry_id(len(self) - 1) if len(self) else None

    def pair_bytes(self) -> np.ndarray:
        """Per entry, the sum of its names' and values' lengths: its size, or an upper bound of
        it when it repeats a name (see `values.entry_bytes`)."""
        sizes = (self.name_len + self.value_len).astype(np.float64)
        return np.bincount(self.pair_entry, weights=sizes, minlength=len(self)).astype(np.int64)

    def values(self, name: bytes) -> pa.Array:
        """Field `name` of every entry as an Arrow binary array: the value of its last pair with
        that name, null where the entry has none."""
        b, n = self.buf, len(self)
        idx = np.flatnonzero(self.name_len == len(name))
        for j, ch in enumerate(name):
            if not len(idx):
                break
            idx = idx[b[self.name_start[idx] + j] == ch]
        entry = self.pair_entry[idx]
        if len(idx) > 1:  # the last pair of an entry wins, as in a dict built in order
            keep = np.ones(len(idx), dtype=bool)
            keep[:-1] = entry[:-1] != entry[1:]
            idx, entry = idx[keep], entry[keep]
        lens = np.zeros(n, dtype=np.int64)
        lens[entry] = self.value_len[idx]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        data = _gather(b, self.value_start[idx], self.value_len[idx])
        validity = None
        if len(idx) < n:
            present = np.zeros(n, dtype=bool)
            present[entry] = True
            validity = pa.py_buffer(np.packbits(present, bitorder="little"))
        return pa.Array.from_buffers(
            pa.binary(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
        )

    def entries(self, lo: int = 0, hi: int | None = None) -> list[list[Any]]:
        """Entries lo..hi as XRANGE replies look parsed by hiredis, `[[id, [f1, v1, ...]], ...]`
        (a Python object per field: for the decoder's event-by-event path only)."""
        hi = len(self) if hi is None else hi
        raw = self.buf.tobytes()
        first = np.searchsorted(self.pair_entry, [lo, hi])
        out: list[list[Any]] = [[self.entry_id(k), []] for k in range(lo, hi)]
        for p in range(int(first[0]), int(first[1])):
            ns, vs = int(self.name_start[p]), int(self.value_start[p])
            fields = out[int(self.pair_entry[p]) - lo][1]
            fields.append(raw[ns : ns + int(self.name_len[p])])
            fields.append(raw[vs : vs + int(self.value_len[p])])
        return out

    def take(self, lo: int, hi: int) -> StreamReply:
        """Entries lo..hi (a view: the same buffer)."""
        a, z = (int(x) for x in np.searchsorted(self.pair_entry, [lo, hi]))
        return StreamReply(
            self.buf,
            self.ms[lo:hi],
            self.seq[lo:hi],
            self.id_start[lo:hi],
            self.id_len[lo:hi],
            self.n_pairs[lo:hi],
            self.pair_entry[a:z] - lo,
            self.name_start[a:z],
            self.name_len[a:z],
            self.value_start[a:z],
            self.value_len[a:z],
        )


def _elements(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(kind byte, number, data start) of every element of a RESP2 reply made of arrays and
    bulk strings only, in order; None if the bytes are not such a reply, or if a bulk string
    holds a CRLF (its data would span lines).

    The reply is cut into lines at each CRLF. A line is an element's header unless the line
    before it is the header of a bulk string (`$`), whose data it then is: so in a run of lines
    that all start with `$`, headers and data alternate from the run's first line on, and the
    line after the run is data if the run's last line is a header. Each bulk string's length
    must then be its data line's length, which no CRLF inside the data can pass.
    """
    n = len(b)
    if n < 4 or b[-2] != 13 or b[-1] != 10:
        return None
    cr = np.flatnonzero(b[:-1] == 13)
    crlf = cr[b[cr + 1] == 10]
    starts = np.empty(len(crlf), dtype=np.int64)
    starts[0] = 0
    starts[1:] = crlf[:-1] + 2
    dollar = b[starts] == _DOLLAR
    # after_dollar[i]: line i-1 starts with `$`; a run starts where it does not.
    after_dollar = np.zeros(len(starts), dtype=bool)
    after_dollar[1:] = dollar[:-1]
    index = np.arange(len(starts))
    run_start = np.maximum.accumulate(np.where(after_dollar, 0, index))
    is_data = after_dollar & ((index - run_start) % 2 == 1)
    header = np.flatnonzero(~is_data)
    kind = b[starts[header]]
    if not ((kind == _STAR) | (kind == _DOLLAR)).all():
        return None
    cand, line_end = starts[header], crlf[header]
    widths = line_end - cand - 1
    first, ok_first = _digits(b, cand[:1] + 1, widths[:1], _MAX_DIGITS)
    number, ok = _digits(b, cand + 1, widths, _MAX_DIGITS, skip_first=True)
    if not (ok.all() and ok_first.all()):
        return None
    number[0] = first[0]
    number = number.astype(np.int64)
    bulk = np.flatnonzero(kind == _DOLLAR)
    data_line = header[bulk] + 1
    if len(bulk) and (
        data_line[-1] >= len(starts)
        or not np.array_equal(crlf[data_line] - starts[data_line], number[bulk])
    ):
        return None
    return kind, number, line_end + 2


def parse_xrange(raw: bytes | bytearray | memoryview) -> StreamReply | None:
    """The XRANGE reply in `raw`, or None if it is not one (see the module docstring)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    parsed = _elements(b)
    if parsed is None:
        return None
    kind, number, data = parsed
    if kind[0] != _STAR:
        return None
    count = int(number[0])
    stars = np.flatnonzero(kind == _STAR)[1:]
    if len(stars) != 2 * count:
        return None
    head, fields = stars[0::2], stars[1::2]
    width = number[fields]
    if count and not (
        np.array_equal(fields, head + 2)
        and (number[head] == 2).all()
        and (kind[head + 1] == _DOLLAR).all()
        and (width % 2 == 0).all()
        and np.array_equal(fields[:-1] + width[:-1] + 1, head[1:])
        and int(fields[-1] + width[-1] + 1) == len(kind)
    ):
        return None
    id_start, id_len = data[head + 1], number[head + 1]
    ms, seq, ok = _entry_ids(b, id_start, id_len)
    if not ok:
        return None
    n_pairs = width // 2
    total = int(n_pairs.sum())
    pair_entry = np.repeat(np.arange(count, dtype=np.int64), n_pairs)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n_pairs) - n_pairs, n_pairs)
    name_el = np.repeat(fields, n_pairs) + 1 + 2 * within
    return StreamReply(
        b, ms, seq, id_start, id_len, n_pairs, pair_entry,
        data[name_el], number[name_el], data[name_el + 1], number[name_el + 1],
    )  # fmt: skip


def _entry_ids(b: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> tuple[Any, Any, bool]:
    """(ms, seq, ok) of stream ids `<ms>-<seq>` written at b[starts : starts + lens]."""
    if not len(starts):
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64), True
    width = int(lens.max())
    if width > 41:
        return None, None, False
    grid = b[np.minimum(starts[:, None] + np.arange(width), len(b) - 1)]
    inside = np.arange(width) < lens[:, None]
    dash_mask = (grid == _DASH) & inside
    if not (dash_mask.sum(axis=1) == 1).all():
        return None, None, False
    dash = dash_mask.argmax(axis=1)
    ms, ok_ms = _digits(b, starts, dash, 20)
    seq, ok_seq = _digits(b, starts + dash + 1, lens - dash - 1, 20)
    return ms, seq, bool(ok_ms.all() and ok_seq.all())
