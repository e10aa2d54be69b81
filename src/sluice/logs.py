"""Structured logs: one line per event, `key=value` pairs (logfmt), on stderr.

    ts=2025-01-02T03:04:05.678Z level=INFO logger=sluice.pipeline.job msg=progress batches=120

`msg` names the event; the facts ride as fields, passed with `extra=`:
`log.info("progress", extra={"batches": 120})`. A value with a space, a quote, `=` or a control
character is written as a JSON string, so a line always splits back into its pairs, and a
traceback stays on the event's line (`exc="Traceback …\\n…"`). Levels stay upper-case
(`level=ERROR`): scripts count them.

Spark's own (JVM) logs are not routed here: `pipeline.spark` sets their level, ERROR by default.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "SLUICE_LOG_LEVEL"  # set by the CLI; read by the processes it starts
SPARK_LOG_LEVEL_ENV = "SLUICE_SPARK_LOG_LEVEL"  # read by `pipeline.spark.build_spark`
# Libraries whose INFO lines are per request or per connection: quiet unless asked for.
NOISY = ("py4j", "uvicorn.access", "httpx", "httpcore", "selenium", "urllib3")
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else str(v)
    if text and all(c > " " and c not in '"=\\' and c != "\x7f" for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)


class KeyValueFormatter(logging.Formatter):
    """`ts level logger msg` first, then the record's extra fields in the order given."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC)
        parts = [
            f"ts={ts.strftime('%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d}Z",
            f"level={record.levelname}",
            f"logger={record.name}",
            f"msg={_value(record.getMessage())}",
        ]
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_"):
                parts.append(f"{k}={_value(v)}")
        if record.exc_info:
            parts.append(f"exc={_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (test runners swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


class Repeats(logging.Filter):
    """Lets one line of a kind through every `every_s` seconds, and says on the next one how
    many like it it held back. A kind is the message with its numbers taken out: a client
    library that logs each failed try of each of its connections (librdkafka, once per
    broker connection and retry) says so once, not thousands of times."""

    MAX_KINDS = 1000  # kinds remembered; beyond it, all are forgotten at once

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self._seen: dict[str, tuple[float, int]] = {}  # kind -> (last let through, held back)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        kind = _NUMBERS.sub("#", text)
        now = self.clock()
        with self._lock:
            last, held = self._seen.get(kind, (None, 0))
            if last is not None and now - last < self.every_s:
                self._seen[kind] = (last, held + 1)
                return False
            if len(self._seen) >= self.MAX_KINDS:
                self._seen.clear()
            self._seen[kind] = (now, 0)
        if held:
            record.msg, record.args = f"{text} ({held} more like it held back)", None
        return True


_NUMBERS = re.compile(r"\d+")


class Handled(logging.Filter):
    """Drops py4j's ERROR, with its traceback, for an error that Sluice reports itself: a
    deposed leader's batch fails with LeaseLost (another process holds the lease) so that Spark
    commits nothing, and the process logs `leadership lost` once (a LeaseLost for any other
    reason, the lease could not be read, is kept); a batch that Redis going away ended (no
    connection, a timeout, Redis loading its data) is the supervisor's to report, and so is one
    whose job was interrupted because its query is being stopped."""

    def filter(self, record: logging.LogRecord) -> bool:
        import redis

        from sluice.errors import LeaseLost, RedisUnavailable

        e = record.exc_info[1] if record.exc_info else None
        if isinstance(e, LeaseLost) and DEPOSED in str(e):
            return False
        # Redis gone: the supervisor says so, in one line, and waits for it
        if isinstance(e, RedisUnavailable | redis.ConnectionError | redis.TimeoutError):
            return False
        # A batch's job cut short because its query is stopped (Spark interrupts the query's
        # thread only then: a stop, or a leader that lost its lease), which the process says
        text = "" if e is None else str(e)
        return not any(marker in text for marker in (*REDIS_GONE, INTERRUPTED))


DEPOSED = "another process holds it"  # a LeaseLost's reason when another process took over
INTERRUPTED = "java.lang.InterruptedException"
# What a task or query that Redis going away ended reports (its Python exception's class)
REDIS_GONE = ("redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError",
              "redis.exceptions.BusyLoadingError", "sluice.errors.RedisUnavailable")  # fmt: skip


_HANDLED = Handled()


def setup_logging(level: str = "info") -> None:
    """Route every logger to stderr as key=value lines at `level` (debug, info, warning, error).

    Idempotent: a second call replaces the handler and the level.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"`level` must be one of {', '.join(LEVELS)}, got {level!r}")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_sluice", False):
            root.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(KeyValueFormatter())
    handler._sluice = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    for name in ("py4j.clientserver", "py4j.java_gateway"):
        logging.getLogger(name).addFilter(_HANDLED)  # a filter is added once


def setup_worker_logging() -> None:
    """In a process that Spark started under the CLI (a source's planner, a Python worker: the
    CLI exports its level in LOG_LEVEL_ENV before Spark starts), route the logs as the CLI's
    own process does, at that level. Without it Python prints a warning as a bare message,
    and its traceback, with no time and no level. Does nothing in a process that set up its
    logging already, or that no CLI started (a test's, a library user's: theirs to set up)."""
    level = os.environ.get(LOG_LEVEL_ENV)
    if level is None or any(getattr(h, "_sluice", False) for h in logging.getLogger().handlers):
        return
    setup_logging(level if level.lower() in LEVELS else "info")
