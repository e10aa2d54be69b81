"""`spark.nice`: a local Spark's threads are lowered, never raised, and the setting is checked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.config import config_from_dict
from sluice.errors import ConfigError
from sluice.pipeline import priority

THREADS = 4
SLEEPER = (
    "import threading, time\n"
    f"for _ in range({THREADS}): threading.Thread(target=time.sleep, args=(60,), daemon=True)"
    ".start()\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[str]]:
    """A process with THREADS threads besides its main one."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield proc
    proc.kill()
    proc.wait()


def nices(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return sorted(os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in tasks)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice is Linux's")
def test_every_thread_is_lowered_and_a_nicer_one_is_left_alone(
    sleeper: subprocess.Popen[str],
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert nices(sleeper.pid) == [base] * (THREADS + 1)
    tids = sorted(int(t.name) for t in Path(f"/proc/{sleeper.pid}/task").iterdir())
    os.setpriority(os.PRIO_PROCESS, tids[-1], 15)  # one thread already nicer than asked
    assert priority.lower_priority(sleeper.pid, 7) == THREADS
    assert nices(sleeper.pid) == [7] * THREADS + [15]
    assert priority.lower_priority(sleeper.pid, 7) == 0  # again: nothing to do
    assert priority.lower_priority(sleeper.pid, 3) == 0  # never raised
    assert nices(sleeper.pid) == [7] * THREADS + [15]


def test_a_process_gone_is_not_an_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    time.sleep(0.05)
    assert priority.lower_priority(proc.pid, 5) == 0


def test_auto_is_ten_on_a_local_master_and_nothing_elsewhere() -> None:
    assert priority.fold_nice("auto", local=True) == priority.AUTO_NICE == 10
    assert priority.fold_nice("auto", local=False) == 0
    assert priority.fold_nice(3, local=False) == 3
    metrics = [{"name": "n", "key": ["key"], "agg": "count"}]
    assert config_from_dict({"metrics": metrics}).spark.nice == "auto"
    assert config_from_dict({"metrics": metrics, "spark": {"nice": 0}}).spark.nice == 0
    for bad in (20, -1, "low"):
        with pytest.raises(ConfigError, match="nice"):
            config_from_dict({"metrics": metrics, "spark": {"nice": bad}})
