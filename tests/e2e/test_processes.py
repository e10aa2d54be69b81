"""The commands as users run them: real processes, real signals, real Redis and Spark."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import yaml

pytestmark = [pytest.mark.spark, pytest.mark.slow]
SLUICE = [sys.executable, "-m", "sluice.cli"]


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _run_config(redis_url: str, tmp_path: Path, **extra: object) -> Path:
    """A one-metric sluice.yaml for `sluice run` on `redis_url`, with `extra` sections."""
    cfg = tmp_path / "sluice.yaml"
    data = {
        "redis": redis_url,
        "state_dir": str(tmp_path / "state"),
        "source": {"format": "jsonl", "schema": {"ts": "long", "card": "string"}},
        "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count"}],
        **extra,
    }
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def test_run_processes_events_and_stops_cleanly_on_sigterm(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _run_config(redis_url, tmp_path, spark={"trigger": "200ms"})
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen([*SLUICE, "run", "-c", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    try:
        now = time.time_ns() // 1_000_000
        r.xadd("events", {"d": b'{"ts": %d, "card": "c1"}\n{"ts": %d, "card": "c1"}' % (now, now)})
        _wait_for(lambda: r.hget("sluice:{stats}", "events_in") == b"2", 120, "the first batch")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "run.log").read_text()
    assert "stopping after the batch in flight" in output
    assert "msg=stopped" in output
    # One key=value line per event; Spark's INFO and WARN chatter stays out by default.
    ours = [line for line in output.splitlines() if " logger=sluice" in line]
    assert len(ours) >= 3, output
    assert all(re.match(r"^ts=\S+Z level=[A-Z]+ logger=sluice\S* msg=", line) for line in ours)
    assert 'msg="pipeline state" state=running' in output
    assert "log4j" not in output and "Setting default log level" not in output
    assert " level=INFO logger=org.apache" not in output
    assert r.xlen("events") <= 1  # committed input was trimmed


# Makes Spark's planner process lose the race of a stop every time (see the module there).
STOP_RACE = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).parent / "stop_race"), os.environ.get("PYTHONPATH")) if p
    ),
}


def _signal_group(
    proc: subprocess.Popen[str], signum: int, ready: Callable[[], None]
) -> tuple[str, str]:
    """Once `ready()` returns, `signum` to `proc`'s whole process group (its JVM included);
    its stdout and stderr once it ended. Killed if it has not ended by the end."""
    try:
        ready()
        os.killpg(proc.pid, signum)
        return proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _traceback_free(text: str) -> None:
    assert "Traceback" not in text and "Error" not in text.replace("level=ERROR", ""), text
    assert "Aborted!" not in text, text


def test_run_stops_with_one_line_when_the_whole_process_group_gets_sigterm(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """What systemd, Kubernetes and `timeout` do: SIGTERM to every process of the group, the
    JVM included. No traceback; the last line says it stopped."""
    cfg = _run_config(redis_url, tmp_path, spark={"trigger": "200ms"})
    proc = subprocess.Popen(
        [*SLUICE, "run", "-c", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, env=STOP_RACE,
    )  # fmt: skip

    def first_batch() -> None:
        now = time.time_ns() // 1_000_000
        r.xadd("events", {"d": b'{"ts": %d, "card": "c1"}' % now})
        _wait_for(lambda: r.hget("sluice:{stats}", "events_in") == b"1", 120, "the first batch")

    out, err = _signal_group(proc, signal.SIGTERM, first_batch)
    assert proc.returncode == 0, err
    _traceback_free(out + err)
    assert err.strip().splitlines()[-1].endswith("msg=stopped"), err


def _java_in_group(pgid: int) -> bool:
    """Whether a `java` process runs in process group `pgid` (Spark's JVM has started)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, _, rest = stat.partition("(")[2].rpartition(")")
        if comm == "java" and int(rest.split()[2]) == pgid:
            return True
    return False


@pytest.mark.parametrize(("command", "after_s"), [("run", 2.0), ("run", 3.5), ("demo", 2.5)])
def test_ctrl_c_while_spark_starts_stops_quietly(
    command: str, after_s: float, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """SIGINT to the group while Spark's context is being made, or just after (PySpark puts a
    handler of its own in place then): a quiet stop, status 0, no ERROR line."""
    cfg = _run_config(redis_url, tmp_path)
    args = (
        ["run", "-c", str(cfg)]
        if command == "run"
        else ["demo", "--port", "0", "--rate", "100", "--state-dir", str(tmp_path / "d")]
    )
    proc = subprocess.Popen(
        [*SLUICE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip

    def spark_starting() -> None:
        _wait_for(lambda: _java_in_group(proc.pid), 60, "Spark's JVM")
        time.sleep(after_s)

    out, err = _signal_group(proc, signal.SIGINT, spark_starting)
    assert proc.returncode == 0, err
    _traceback_free(out + err)
    assert "level=ERROR" not in err, err
    if command == "run":
        last = err.strip().splitlines()[-1]
        assert last.endswith(("msg=stopped", 'msg="stopped before the pipeline started"')), err
    else:
        assert out.strip().splitlines()[-1].startswith("stopped"), out


def test_demo_stops_with_one_line_on_ctrl_c_to_the_process_group(tmp_path: Path) -> None:
    """Ctrl-C in a terminal: SIGINT to the foreground process group."""
    proc = subprocess.Popen(
        [*SLUICE, "demo", "--port", "0", "--rate", "200", "--state-dir", str(tmp_path / "d")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**STOP_RACE, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    stdout = proc.stdout

    def first_status_line() -> None:
        deadline = time.monotonic() + 150
        for line in stdout:
            if "total" in line or time.monotonic() > deadline:
                break

    out, err = _signal_group(proc, signal.SIGINT, first_status_line)
    assert proc.returncode == 0, err
    _traceback_free(out + err)
    lines = out.strip().splitlines()
    assert lines[-2] == "stopping..." and lines[-1].startswith("stopped: "), out
