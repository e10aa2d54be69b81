"""Python's cyclic garbage collector, kept off the paths that move many objects.

CPython collects cycles in three generations; a collection of the oldest traverses every
tracked object of the process. Two places paid for that on every batch:

- A walk's XRANGE chunk parsed by hiredis (`source.walk`) is some 20,000 lists per 10,000
  `fields` entries, and the collections their allocation set off made a walk cost 2.6 times
  the CPU (bench/collector.py). `paused()` holds the collector off until the chunk is
  dropped: its lists form no cycles, and reference counting frees them.
- A Spark Python worker runs one task after another in a process that holds some 115,000
  objects (pyspark, pyarrow, pandas, Sluice), and collected its oldest generation about once a
  batch, at 55-80 ms of CPU each. `settle()` moves the objects a worker holds when its first
  task starts into the permanent generation (`freeze`), which no collection traverses; each
  collection after it sees only the objects made since (8-18 ms each in a drain, against
  55-80 ms before, seen with a `gc.callbacks` hook in each process).
  Nothing is kept alive by this: frozen objects are still freed when their last reference
  goes. The HTTP server freezes what it built once it is up, for the same reason.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pause = {"depth": 0, "restore": False}
_settled = {"pid": 0}


@contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block. Nested and concurrent pauses (the walk ahead runs beside
    the planner) end together: the collector is enabled again, if it was on, when the last
    one ends."""
    with _lock:
        if _pause["depth"] == 0:
            _pause["restore"] = gc.isenabled()
            gc.disable()
        _pause["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _pause["depth"] -= 1
            if _pause["depth"] == 0 and _pause["restore"]:
                gc.enable()


def freeze() -> None:
    """Collect what is garbage now, then move every object left into the permanent
    generation."""
    gc.collect()
    gc.freeze()


def settle() -> None:
    """`freeze` once per process (a process forked after it settles again). Called by the
    executor side's entry points, which a Spark worker runs once per task, and so also by the
    driver when it writes a batch behind."""
    pid = os.getpid()
    if _settled["pid"] == pid:
        return
    with _lock:
        if _settled["pid"] != pid:
            freeze()
            _settled["pid"] = pid
