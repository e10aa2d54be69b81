"""An event as the producer writes it into a log entry: a JSON line (`jsonl`, Kafka's `json`)
or a stream entry's fields (`fields`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import orjson

from sluice.errors import BadEvent


def event_line(event: Mapping[str, Any]) -> bytes:
    """One event as a JSON line. orjson writes a NaN or ±infinity as `null`, which would turn a
    bad value into a missing one (or into no value at all, in an optional field); such an
    event is written with Python's `NaN`, `Infinity` and `-Infinity` instead, which the
    decoder reads as the `non_finite` dead letter, as it does a `fields` event's `nan`."""
    try:
        line = orjson.dumps(event)
        if b"null" in line and any(
            isinstance(v, float) and not math.isfinite(v) for v in event.values()
        ):
            line = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError) as e:
        raise BadEvent(f"event is not JSON-serialisable: {e}") from None
    return line


def entry_bytes(fields: Mapping[str, bytes | str]) -> int:
    """A `fields` entry's size as the source counts it: its names' and values' UTF-8 bytes."""
    return sum(len(k.encode("utf-8", "replace"))
               + len(v if isinstance(v, bytes) else v.encode("utf-8", "replace"))
               for k, v in fields.items())  # fmt: skip


def entry_fields(event: Mapping[str, Any]) -> dict[str, bytes | str]:
    """A `fields` entry's fields: the event's fields that have a value, as text. Raises
    BadEvent for a name that is not text, a value JSON cannot carry, or no field at all."""
    out: dict[str, bytes | str] = {}
    for k, v in event.items():
        if not isinstance(k, str):
            raise BadEvent(f"a field name must be text, got {k!r}")
        if v is not None:
            try:
                out[k] = _field_value(v)
            except TypeError as e:
                raise BadEvent(f"field {k!r} cannot be written: {e}") from None
    if not out:
        raise BadEvent(
            f"an event in the `fields` format needs a field with a value (a stream entry"
            f" cannot be empty), got {dict(event)!r}"
        )
    return out


def _field_value(v: Any) -> bytes | str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, bytes | str):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    return orjson.dumps(v)
