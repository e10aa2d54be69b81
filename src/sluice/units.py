"""Parsing of human durations (`500ms`, `1m`, `7d`) and sizes (`50MB`, `500KB`)."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal

_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_SIZE_BYTES = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
# ASCII digits only: `\d` alone would also take other scripts' digits ("١m").
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$", re.ASCII)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE | re.ASCII)


def parse_duration_ms(value: str | int | float) -> int:
    """`"1m"` -> 60000. A bare number is taken as milliseconds. Raises ValueError."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"duration must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"duration must not be negative, got {value!r}")
        if value != int(value):
            raise ValueError(f"duration {value!r} is not a whole number of milliseconds")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as '500ms' or '1m', got {value!r}")
    m = _DURATION_RE.match(value)
    if not m:
        raise ValueError(
            f"expected a duration such as '500ms', '2s', '1m', '1h' or '7d', got {value!r}"
        )
    ms = Decimal(m.group(1)) * _DURATION_MS[m.group(2)]  # exact: 1.001s is 1001 ms
    if ms != int(ms):
        raise ValueError(f"duration {value!r} is not a whole number of milliseconds")
    return int(ms)


def parse_size_bytes(value: str | int) -> int:
    """`"50MB"` -> 50_000_000 (KB/MB/GB are decimal, KiB/MiB/GiB binary). Raises ValueError."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '500KB' or '50MB', got {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"expected a size such as '500KB', '50MB' or '1GiB', got {value!r}")
    unit = (m.group(2) or "b").lower()
    size = Decimal(m.group(1)) * _SIZE_BYTES[unit]
    if size != int(size):
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(size)


def format_duration_ms(ms: int) -> str:
    """The shortest exact spelling: 60000 -> '1m', 1500 -> '1500ms'."""
    for unit in ("w", "d", "h", "m", "s"):
        size = _DURATION_MS[unit]
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def duration_text(seconds: float) -> str:
    """A span for people: `0.8 s`, `42 s`, `3 min 05 s`, `2 h 07 min`, `6 d 22 h`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86_400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86_400} d {s % 86_400 // 3600:02d} h"


EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def iso_ms(ms: int) -> str:
    """Epoch ms as ISO 8601 UTC: `2026-11-01T12:00:00Z` (milliseconds shown when not 0)."""
    try:
        when = EPOCH + dt.timedelta(milliseconds=ms)
    except OverflowError:  # past year 9999: no calendar date to show
        return f"{ms} ms since the epoch"
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{ms % 1000:03d}Z" if ms % 1000 else f"{text}Z"
