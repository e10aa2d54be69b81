"""Redis stream entry ids (`<ms>-<seq>`) as offsets: parse, compare, split into ranges."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MAX_SEQ = 2**64 - 1
ZERO_ID = "0-0"


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def entry_id_columns(entry_ids: list[bytes]) -> tuple[Any, Any]:
    """(ms, seq) of stream entry ids (`b"<ms>-<seq>"`) as two uint64 arrays, parsed by Arrow's
    kernels rather than one Python call per id."""
    if not entry_ids:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    text = pc.cast(pa.array(entry_ids, pa.binary()), pa.string())
    parts = pc.list_flatten(pc.split_pattern(text, "-", max_splits=1))
    both = pc.cast(parts, pa.uint64()).to_numpy()
    if len(both) != 2 * len(entry_ids):
        raise ValueError("a stream entry id is not <ms>-<seq>")
    return both[0::2], both[1::2]


def format_id(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def id_ms(entry_id: str | bytes) -> int:
    return parse_id(entry_id)[0]


def split_range(start_id: str, end_id: str, parts: int) -> list[tuple[str, str]]:
    """Split (start_id, end_id] into at most `parts` consecutive (lo, hi] ranges by entry time.

    Entries are spread by their millisecond part; ranges never overlap and always cover the
    whole input, so a replay of the same (start, end) reads exactly the same entries.
    """
    s_ms, _ = parse_id(start_id)
    e_ms, _ = parse_id(end_id)
    if parts <= 1 or e_ms - s_ms < parts:
        return [(start_id, end_id)]
    step = (e_ms - s_ms) / parts
    out: list[tuple[str, str]] = []
    lo = start_id
    for i in range(1, parts):
        cut_ms = s_ms + int(step * i)
        hi = format_id(cut_ms, MAX_SEQ)
        out.append((lo, hi))
        lo = hi
    out.append((lo, end_id))
    return out


# -- 64-bit event ids (the completeness audit's currency) -------------------------------------

_MASK = (1 << 64) - 1


def _mix64(z: Any) -> Any:
    """SplitMix64's finaliser, on a numpy uint64 array (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_salt(stream: str) -> int:
    """A stream's share of its events' ids: 64 bits of BLAKE2b of its key name.

    Entry ids are only unique within one stream: two shards written in the same millisecond
    both hold `<ms>-0`. Without the salt their events would share ids, and the audit's XOR
    would cancel them in pairs, hiding exactly the losses it exists to catch.
    """
    return int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")


def event_ids(ms: Any, seq: Any, idx: Any, stream: str) -> Any:
    """The 64-bit id of each event: a hash of (stream, entry ms, entry seq, index in the entry).

    Arrays in, int64 array out (the same bits as an unsigned id, as Spark's `long`). The source
    and the audit compute it independently from the same four values, so the only contract is
    this function; it is pseudo-random, so distinct events collide with probability ~2^-64.
    """
    ms64 = np.asarray(ms, dtype=np.int64).astype(np.uint64)
    seq64 = np.asarray(seq, dtype=np.uint64)
    idx64 = np.asarray(idx, dtype=np.int64).astype(np.uint64)
    salt = np.uint64(stream_salt(stream))
    with np.errstate(over="ignore"):
        h = _mix64(_mix64(ms64 ^ salt) ^ seq64) ^ _mix64(idx64 ^ np.uint64(0xD6E8FEB86659FD93))
        return _mix64(h).view(np.int64)


def xor_all(ids: Any) -> int:
    """XOR of an int64 id array, as an unsigned 64-bit Python int."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size == 0:
        return 0
    return int(np.bitwise_xor.reduce(arr.view(np.uint64))) & _MASK
