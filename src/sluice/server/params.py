"""Request parameters and bodies, parsed into values or a `QueryError` (HTTP 400) that names
the parameter."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_plus

import orjson
from pydantic import BaseModel, Field, field_validator

from sluice.errors import BadQuery, QueryError
from sluice.status.dead_letters import DEFAULT_LIMIT, MAX_LIMIT, reason_error
from sluice.status.history import HISTORY_LEN

MAX_EVENTS_PER_REQUEST = 100_000


class Lookup(BaseModel):
    metric: str = Field(description="metric or derived metric name")
    key: list[str] | str = Field(description="key value(s), one per key field")
    window: str = Field(description="window length, e.g. 15m", examples=["15m"])
    end: int | None = Field(None, description="window end in epoch ms; default now")

    @field_validator("metric", "key", "window")
    @classmethod
    def _utf8(cls, v: Any) -> Any:
        """A lone surrogate (`"\\ud800"`, which Python's JSON parser accepts) has no UTF-8
        bytes, so it can name no metric or key: refused here, not a 500 where it is sent."""
        for text in [v] if isinstance(v, str) else v:
            try:
                text.encode()
            except UnicodeEncodeError:
                raise ValueError(f"{text!r} is not valid Unicode (a lone surrogate)") from None
        return v

    @field_validator("end", mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # pydantic would read `true` as 1 ms
            raise ValueError("must be epoch milliseconds, not a boolean")
        if isinstance(v, float):  # pydantic's own message ("unable to parse input string")
            # would not say what is wrong with a number
            if v != v or v in (float("inf"), float("-inf")) or not v.is_integer():
                raise ValueError(f"must be epoch milliseconds, a whole number; got {v!r}")
            if not -(2**63) <= v < 2**63:
                raise ValueError(f"must be epoch milliseconds; {v!r} is out of range")
        return v


class BatchQuery(BaseModel):
    queries: list[Lookup] = Field(max_length=1000)


class ErrorDetail(BaseModel):
    code: str = Field(description="a stable name, e.g. bad_request, unknown_metric")
    message: str = Field(description="what was wrong, naming the parameter")


class ErrorBody(BaseModel):
    """Every error the API answers (`middleware.error`)."""

    error: ErrorDetail


_ERRORS = {
    400: "a malformed parameter or body (the message names it)",
    401: "a missing or wrong bearer token",
    404: "an unknown metric or path",
    413: "a body over the size limit",
    422: "a well-formed query that cannot be answered (a window past the retention)",
    429: "the input is backpressured: retry after `Retry-After` seconds",
    503: "the slice store (Redis) or the log is unavailable, or loading",
}
# The OpenAPI spec's error answers, in the shape the API gives them (FastAPI's own 422 model is
# never sent: a request that does not validate is answered 400).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in _ERRORS.items()
}


def parse_history(value: str | None) -> int | None:
    """The `history` query parameter: seconds from 0 to HISTORY_LEN, or QueryError (400)."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or int(value) > HISTORY_LEN:
        raise BadQuery(
            f"`history` must be a number of seconds from 0 to {HISTORY_LEN}, got {value!r}",
            "history",
        )
    return int(value)


def check_query(query_string: bytes, single: tuple[str, ...] = ()) -> None:
    """Refuse (BadQuery, 400) a query parameter whose percent-decoded bytes are not UTF-8
    (`key=%FF`): read leniently, as web frameworks do, it would stand for another key; and one
    of `single` given twice (its name as decoded), of which a framework keeps one without a
    word."""
    seen: set[str] = set()
    for part in query_string.decode("latin-1").split("&"):
        name, _, value = part.partition("=")
        try:
            unquote_plus(value, errors="strict")
            param = unquote_plus(name, errors="strict")
        except UnicodeDecodeError:
            param = unquote_plus(name)
            raise BadQuery(
                f"`{param}` is not UTF-8 once percent-decoded: {value!r}", param
            ) from None
        if param in single:
            if param in seen:
                raise BadQuery(f"`{param}` is given more than once; give it once", param)
            seen.add(param)


def parse_limit(value: str | None) -> int:
    """The `limit` query parameter: an integer from 1 to MAX_LIMIT, or BadQuery (400)."""
    if value is None:
        return DEFAULT_LIMIT
    n = int(value) if value.isascii() and value.isdigit() else 0  # not int()'s "1_0", "+1"
    if not 1 <= n <= MAX_LIMIT:
        raise BadQuery(f"`limit` must be an integer from 1 to {MAX_LIMIT}, got {value!r}", "limit")
    return n


def parse_reason(value: str | None) -> str | None:
    """The `reason` query parameter: a dead-letter reason such as `bad_json`, or BadQuery
    (400)."""
    if value is None:
        return None
    why = reason_error(value)
    if why is not None:
        raise BadQuery(f"`reason`: {why}", "reason")
    return value


def parse_events(raw: bytes) -> list[dict[str, Any]]:
    """A JSON array of objects, or NDJSON (one object per line), with or without a UTF-8
    byte-order mark (some Windows tools write one). Raises QueryError (400)."""
    text = raw.removeprefix(b"\xef\xbb\xbf").strip()
    if not text:
        raise QueryError("body is empty; send a JSON array of events or NDJSON", "body")
    events: Any
    if text[:1] == b"[":
        try:
            events = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise QueryError(f"body is not a valid JSON array: {e}", "body") from None
    else:
        events = []
        for n, line in enumerate(text.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                raise QueryError(f"NDJSON line {n} is not valid JSON: {e}", "body") from None
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise QueryError(f"event {i} is not a JSON object", "body")
    if len(events) > MAX_EVENTS_PER_REQUEST:
        raise QueryError(f"at most {MAX_EVENTS_PER_REQUEST} events per request", "body")
    try:  # orjson reads deeper nesting than it writes: refuse it before anything is sent
        orjson.dumps(events)
    except orjson.JSONEncodeError as e:
        raise QueryError(f"body cannot be re-encoded as JSON: {e}", "body") from None
    return list(events)
