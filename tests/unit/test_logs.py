"""The log line format: one line per event, key=value pairs that split back."""

from __future__ import annotations

import logging
import re

import pytest

from sluice.logs import KeyValueFormatter, setup_logging

LINE = re.compile(
    r'^ts=\S+Z level=[A-Z]+ logger=\S+ msg=("(?:[^"\\]|\\.)*"|\S+)( \w+=("(?:[^"\\]|\\.)*"|\S+))*$'
)


def _format(msg: str, level: int = logging.INFO, **extra: object) -> str:
    rec = logging.LogRecord("sluice.x", level, __file__, 1, msg, None, None)
    rec.__dict__.update(extra)
    return KeyValueFormatter().format(rec)


def test_bare_values_stay_bare_and_others_are_quoted() -> None:
    line = _format("stopped")
    assert " level=INFO logger=sluice.x msg=stopped" in line and LINE.match(line)
    line = _format("batch written", batch=12, error='bad "x" = y', path="/a b")
    assert 'msg="batch written" batch=12 error="bad \\"x\\" = y" path="/a b"' in line
    assert LINE.match(line), line


def test_an_exception_stays_on_its_event_line() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        rec = logging.LogRecord("sluice.x", logging.ERROR, __file__, 1, "failed", None, None)
        rec.exc_info = sys.exc_info()
    line = KeyValueFormatter().format(rec)
    assert "\n" not in line and "exc=" in line and "ValueError: boom" in line
    assert line.startswith("ts=") and " level=ERROR " in line


def test_setup_logging_sets_the_level_and_rejects_an_unknown_one() -> None:
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        setup_logging("warning")
        assert root.level == logging.WARNING
        setup_logging("debug")  # a second call replaces, not adds, its handler
        assert sum(1 for h in root.handlers if getattr(h, "_sluice", False)) == 1
        assert logging.getLogger("py4j").level == logging.WARNING  # chatter stays quiet
        with pytest.raises(ValueError, match="`level` must be one of"):
            setup_logging("loud")
    finally:
        root.handlers[:] = before[1]
        root.setLevel(before[0])
