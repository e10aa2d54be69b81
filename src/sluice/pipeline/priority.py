"""A local Spark yields the cores to the writes that make a batch queryable.

On a local master the fold (Spark's JVM and the Python workers it starts) shares the machine's
cores with the store's work: Redis running the slice scripts (embedded, or another Redis on
this machine) and, under write-behind (`pipeline.behind`), the driver's writer thread. While a
batch is written the next one is folded, and when both want a core the scheduler splits it
evenly, though the write is what the next batch waits for and what makes answers fresh. Paired
drains of the high-cardinality workload (bench/ingest.py's cells, one Spark session, 3 pairs
alternating) ran 21.3k events/s (`jsonl`) and 21.9k (`fields`) with the JVM at the default
priority, 26.7k and 26.0k with it at nice 10, every pair in favour; the Zipf workload, whose
writes are small, was not slowed (110.8k against 115.8k, `fields`). A nice value only matters
when cores are contended: an idle machine gives the fold every core it asks for.

`spark.nice` (`auto`: 10 on a local master this process starts, else left alone) is applied
once, right after the JVM starts. Linux keeps a nice value per thread and a new thread or
process inherits its creator's, so lowering every thread the JVM has then covers the threads
and Python workers it starts later. A priority is only ever lowered, never raised (raising it
needs privileges), and a failure to set it is logged, not raised: the fold runs either way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

AUTO_NICE = 10
PASSES = 3  # a thread started mid-pass by a thread not yet lowered is caught by the next pass


def fold_nice(setting: int | str, local: bool) -> int:
    """`spark.nice` as a number: `auto` is AUTO_NICE on a local master this process started,
    0 (leave it alone) otherwise."""
    if setting == "auto":
        return AUTO_NICE if local else 0
    return int(setting)


def jvm_pid(spark: Any) -> int | None:
    """The pid of the JVM this process launched for `spark`, or None (spark-submit started it,
    or the gateway does not say)."""
    proc = getattr(getattr(spark.sparkContext, "_gateway", None), "proc", None)
    return getattr(proc, "pid", None)


def lower_priority(pid: int, nice: int) -> int:
    """Set every thread of process `pid` to at least `nice` (a thread already nicer is left
    alone). Returns how many threads were lowered."""
    task_dir = Path(f"/proc/{pid}/task")
    if not task_dir.is_dir():  # not Linux: the call sets the whole process
        return int(_lower(pid, nice))
    lowered = 0
    for _ in range(PASSES):
        changed = sum(_lower(int(t.name), nice) for t in task_dir.iterdir() if t.name.isdigit())
        lowered += changed
        if not changed:
            break
    return lowered


def _lower(tid: int, nice: int) -> bool:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
        return False


def apply(spark: Any, setting: int | str, local: bool) -> None:
    """Lower the priority of the JVM behind `spark` as `spark.nice` says (see the module doc)."""
    nice = fold_nice(setting, local)
    pid = jvm_pid(spark) if nice > 0 else None
    if pid is None:
        return
    try:
        n = lower_priority(pid, nice)
    except OSError as e:
        log.warning("could not lower the Spark JVM's priority", extra={"error": str(e)})
        return
    log.info("spark priority", extra={"jvm_pid": pid, "nice": nice, "threads": n})
