"""A lookup's parameters read from a request: its window and its end."""

from __future__ import annotations

import functools
from typing import Any

from sluice.errors import BadQuery
from sluice.units import parse_duration_ms


def parse_window(value: Any, param: str = "window") -> int:
    if isinstance(value, str) and len(value) <= 32:
        return parse_window_text(value, param)  # requests repeat a few windows: made once
    return _parse_window(value, param)


def _parse_window(value: Any, param: str) -> int:
    if value is None or value == "":
        raise BadQuery(f"`{param}` is required, e.g. {param}=15m", param)
    try:
        ms = parse_duration_ms(value)
    except (ValueError, TypeError) as e:
        raise BadQuery(f"`{param}` {value!r} is not a duration: {e}", param) from None
    if ms <= 0:
        raise BadQuery(f"`{param}` must be positive, got {value!r}", param)
    if ms > 10 * 365 * 86_400_000:
        raise BadQuery(f"`{param}` {value!r} is longer than ten years", param, 422)
    return ms


parse_window_text = functools.lru_cache(maxsize=1024)(_parse_window)


def parse_end(value: Any, now_ms: int) -> int:
    if value is None or value == "":
        return now_ms
    if isinstance(value, bool):
        raise BadQuery(f"`end` must be epoch milliseconds, got {value!r}", "end")
    try:  # an int, or its ASCII digits: not int()'s "1_000", "+1" or other scripts' digits
        if isinstance(value, str) and not (value.isascii() and value.isdigit()):
            raise ValueError(value)
        end = int(value)
    except (ValueError, TypeError):
        raise BadQuery(
            f"`end` must be epoch milliseconds (an integer), got {value!r}", "end"
        ) from None
    if not 0 <= end < 2**53:
        raise BadQuery(f"`end` {end} is out of range", "end")
    return end


def seconds_hint(end_ms: int, now_ms: int) -> str:
    """A hint for an `end` that reads as now in epoch seconds, not milliseconds."""
    if abs(end_ms * 1000 - now_ms) <= 366 * 86_400_000:
        return f" (`end` is in epoch milliseconds: {end_ms} looks like seconds)"
    return ""
