"""The log line format: one line per event, key=value pairs that split back."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from sluice.logs import LOG_LEVEL_ENV, KeyValueFormatter, Repeats, setup_logging

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


def _worker(env: dict[str, str]) -> str:
    """stderr of a fresh process that sets up a worker's logging, then logs a warning, an info
    line and a debug line."""
    code = (
        "import logging\n"
        "from sluice.logs import setup_worker_logging\n"
        "setup_worker_logging()\n"
        "log = logging.getLogger('sluice.source.admission')\n"
        "log.warning('flow control failed', extra={'error': 'Connection refused'})\n"
        "log.info('flow control recovered')\n"
        "log.debug('detail')\n"
    )
    base = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    done = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    return done.stderr


def test_a_process_started_under_the_cli_logs_as_the_cli_does() -> None:
    lines = _worker({LOG_LEVEL_ENV: "info"}).splitlines()
    assert len(lines) == 2
    assert all(line.startswith("ts=") for line in lines)
    assert ' level=WARNING logger=sluice.source.admission msg="flow control failed"' in lines[0]
    assert lines[0].endswith(' error="Connection refused"')
    assert " level=INFO " in lines[1]
    assert _worker({LOG_LEVEL_ENV: "warning"}).count("\n") == 1  # the CLI's level holds


def test_a_process_no_cli_started_keeps_its_own_logging() -> None:
    assert _worker({}) == "flow control failed\n"  # Python's default: the user's to set up


def test_repeated_lines_of_a_kind_go_through_once_a_while_and_say_how_many_were_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """librdkafka logs each failed try of each broker connection: 707 lines in 40 ms on a stop
    after an outage. One of a kind (numbers aside) goes through every 10 s."""
    now = [100.0]
    logger = logging.getLogger("sluice.test.repeats")
    repeats = Repeats(10.0, clock=lambda: now[0])
    logger.addFilter(repeats)
    try:
        with caplog.at_level(logging.DEBUG, logger="sluice.test.repeats"):
            for i in range(700):
                logger.error("FAIL [rdkafka#consumer-%d] Connect to 127.0.0.1:7401 failed"
                             " (after %dms in state CONNECT)", i % 3, i)  # fmt: skip
            logger.error("another kind of line")
            now[0] += 10.0
            logger.error("FAIL [rdkafka#consumer-1] Connect to 127.0.0.1:7401 failed (after 3ms"
                         " in state CONNECT)")  # fmt: skip
    finally:
        logger.removeFilter(repeats)
    assert caplog.messages == [
        "FAIL [rdkafka#consumer-0] Connect to 127.0.0.1:7401 failed (after 0ms in state CONNECT)",
        "another kind of line",
        "FAIL [rdkafka#consumer-1] Connect to 127.0.0.1:7401 failed (after 3ms in state CONNECT)"
        " (699 more like it held back)",
    ]


def test_librdkafka_logs_through_the_repeats_filter() -> None:
    from sluice.graph import KAFKA_LOG, KafkaSpec

    spec = KafkaSpec(bootstrap="127.0.0.1:9092", topic="t", group_id="g")
    assert spec.client_config()["logger"] is KAFKA_LOG
    assert any(isinstance(f, Repeats) for f in KAFKA_LOG.filters)


def test_py4j_s_error_for_a_deposed_leader_s_batch_is_dropped_and_others_kept() -> None:
    """A batch a deposed leader fails on purpose (LeaseLost) makes py4j log an ERROR with its
    traceback; the process logs `leadership lost` itself, once. Any other error is kept."""
    from sluice.errors import LeaseLost

    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    try:
        setup_logging("info")
        setup_logging("info")  # the filter is added once
        root.addHandler(Keep())
        py4j = logging.getLogger("py4j.clientserver")
        unread = LeaseLost("spark", "could not read it: Timeout")  # no `leadership lost` line
        for err in (LeaseLost("spark", "another process holds it"), unread, ValueError("boom")):
            try:
                raise err
            except (LeaseLost, ValueError):
                py4j.exception("There was an exception while executing the Python Proxy")
        assert [r.exc_info[1] for r in records if r.exc_info] == [unread, err]
        assert len(py4j.filters) == 1
    finally:
        root.handlers[:] = before[1]
        root.setLevel(before[0])
