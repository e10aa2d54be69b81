"""`sluice demo` asked to stop before Spark starts (a Ctrl-C while its Redis and its API start):
it never starts Spark, and says so in one line. A real embedded Redis and API server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sluice.demo import run_demo


def test_a_stop_before_spark_starts_starts_no_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = threading.Event()
    stop.set()
    t0 = time.monotonic()
    run_demo(tmp_path / "state", duration_s=60, rate=100, port=0, stop=stop)
    assert time.monotonic() - t0 < 15  # Redis and the API only: no JVM
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "stopped before the pipeline started", out
    assert not any("starting Spark" in line for line in out), out
