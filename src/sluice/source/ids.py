"""Redis stream entry ids (`<ms>-<seq>`) as offsets: parse, compare, split into ranges."""

from __future__ import annotations

MAX_SEQ = 2**64 - 1
ZERO_ID = "0-0"


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


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
