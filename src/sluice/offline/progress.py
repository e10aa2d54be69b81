"""A backfill's progress: what each write task says as it goes, and the driver's reading of it.

Spark counts a task's records only when the task ends, and most of a backfill's time is its
last stage: a few long tasks, each folding and writing a whole partition. So each write task
says how far it is itself, in one field of `<run key>:tasks` (its partition's; a retry writes
over it): when it started, the events it took in, the slices written so far and the share of
its cells they are, and when it ended.

The time left is a schedule, not a ratio of tasks: a task takes as long as the tasks that
ended took (their median), or, before any ended, as long as the running ones' share written so
far says; one that runs longer has what its own share says left (and while it has written
nothing, there is no estimate: it may still be taking its rows in). The partitions not started
yet run after the running ones, as many at once as Spark has task slots. Until the write starts
there is no estimate: how long the read takes says little about how long the write will.
"""

from __future__ import annotations

import heapq
import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis

log = logging.getLogger(__name__)

Progress = Callable[[dict[str, Any]], None]


def tasks_key(run_key: str) -> str:
    return f"{run_key}:tasks"


class TaskProgress:
    """One write task's field in `<run key>:tasks`. A failed report is logged, never raised:
    the writes themselves say whether the store is there."""

    def __init__(self, client: Any, run_key: str, part: int, ttl_s: int) -> None:
        self.client, self.key, self.part, self.ttl_s = client, tasks_key(run_key), part, ttl_s
        self.state: dict[str, Any] = {"t0": time.time(), "events": 0, "slices": 0, "share": 0.0,
                                      "end": None, "skipped": False}  # fmt: skip
        self._put()

    def took_in(self, events: int) -> None:
        self.state["events"] = events
        self._put()

    def wrote(self, slices: int, share: float) -> None:
        self.state["slices"] += slices
        self.state["share"] = min(1.0, share)
        self._put()

    def ended(self, skipped: bool = False) -> None:
        self.state.update(end=time.time(), share=1.0, skipped=skipped)
        self._put()

    def _put(self) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.key, str(self.part), orjson.dumps(self.state))
            pipe.expire(self.key, self.ttl_s)
            pipe.execute()
        except redis.RedisError as e:
            log.debug("backfill task progress", extra={"error": str(e)})


def time_left(tasks: list[dict[str, Any]], partitions: int, slots: int,
              now: float) -> float | None:  # fmt: skip
    """Seconds until every partition is written (the module's docstring), or None while no
    task has written anything."""
    running = [t for t in tasks if t["end"] is None]
    took = [t["end"] - t["t0"] for t in tasks if t["end"] is not None and not t["skipped"]]
    if not took:
        took = [(now - t["t0"]) / t["share"] for t in running if t["share"] > 0]
    if not took:
        return None
    each = statistics.median(took)
    rests = [_rest(t, each, now) for t in running]
    if None in rests:  # a task past a task's length with nothing written: no telling
        return None
    free = [r for r in rests if r is not None]
    free += [0.0] * max(slots - len(free), 0)  # idle slots
    heapq.heapify(free)
    for _ in range(max(partitions - len(tasks), 0)):
        heapq.heappush(free, heapq.heappop(free) + each)
    return max(free, default=0.0)


class Watcher(threading.Thread):
    """Calls `progress` every `every_s` with where the backfill is: `phase` (planning, reading,
    writing), Spark's tasks done over the job group's stages, the write tasks' partitions
    done, events taken in and slices written, the rate and the time left."""

    def __init__(self, spark: Any, group: str, client: Any, run_key: str, partitions: int,
                 progress: Progress, every_s: float) -> None:  # fmt: skip
        super().__init__(name="sluice-backfill-progress", daemon=True)
        self.spark, self.group, self.client, self.run_key = spark, group, client, run_key
        self.partitions, self.progress, self.every_s = partitions, progress, every_s
        self.slots = max(1, int(spark.sparkContext.defaultParallelism))
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        tracker = self.spark.sparkContext.statusTracker()
        done = total = 0
        for job in tracker.getJobIdsForGroup(self.group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info else ():
                st = tracker.getStageInfo(stage)
                if st is not None:
                    done, total = done + st.numCompletedTasks, total + st.numTasks
        tasks = [orjson.loads(v) for v in self.client.hvals(tasks_key(self.run_key))]
        events = sum(t["events"] for t in tasks)
        elapsed = time.monotonic() - self.t0
        return {
            "phase": "writing" if tasks else "reading" if total else "planning",
            "tasks_done": done,
            "tasks": total,
            "partitions_done": sum(t["end"] is not None for t in tasks),
            "partitions": self.partitions,
            "events": events,
            "slices": sum(t["slices"] for t in tasks),
            "elapsed_s": round(elapsed, 1),
            "events_per_s": round(events / elapsed) if elapsed > 0 else 0,
            "left_s": _rounded(time_left(tasks, self.partitions, self.slots, time.time())),
        }

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.progress(self.snapshot())
            except Exception as e:  # noqa: BLE001 - progress must never fail the backfill
                log.debug("backfill progress", extra={"error": str(e)})


def _rest(task: dict[str, Any], each: float, now: float) -> float | None:
    """What is left of a running task: of a task's length, or once it runs longer than that,
    what its own share written says (None before it wrote: it may still be taking in)."""
    share, age = task["share"], now - task["t0"]
    if age < each:
        return each - age
    return age * (1 - share) / share if share > 0 else None


def _rounded(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds)
