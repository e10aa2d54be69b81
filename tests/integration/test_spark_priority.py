"""A local Spark started by Sluice runs below the store's writes (`spark.nice: auto`), and so do
the Python workers it starts afterwards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sluice.pipeline import priority

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="per-thread nice is Linux's"
)


def test_the_jvm_and_its_python_workers_run_at_nice_ten(spark: Any) -> None:
    pid = priority.jvm_pid(spark)
    assert pid is not None and pid != os.getpid()
    threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    assert len(threads) > 10  # a JVM's many threads, every one of them lowered
    assert min(os.getpriority(os.PRIO_PROCESS, t) for t in threads) >= priority.AUTO_NICE
    workers = (
        spark.sparkContext.parallelize(range(8), 4)
        .map(lambda _: (os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)))
        .collect()
    )
    assert {w for w, _ in workers} - {os.getpid()}  # ran in Python workers, not here
    assert min(n for _, n in workers) >= priority.AUTO_NICE
    assert os.getpriority(os.PRIO_PROCESS, 0) < priority.AUTO_NICE  # the driver is not lowered
