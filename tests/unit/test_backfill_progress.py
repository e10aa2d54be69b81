"""The time a backfill's progress line says is left (`offline.progress.time_left`): a schedule
of the partitions still to write over Spark's task slots."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.offline.progress import time_left

NOW = 1_000.0


def task(age: float, share: float = 0.0, took: float | None = None,
         skipped: bool = False) -> dict[str, Any]:  # fmt: skip
    """A task that started `age` s ago; `took` s if it has ended."""
    end = None if took is None else NOW - age + took
    return {"t0": NOW - age, "share": share, "end": end, "skipped": skipped,
            "events": 0, "slices": 0}  # fmt: skip


def test_nothing_is_said_before_a_task_has_written() -> None:
    assert time_left([], 4, 2, NOW) is None
    assert time_left([task(5.0), task(5.0)], 4, 2, NOW) is None


def test_before_any_task_ends_the_running_tasks_share_sets_a_task_s_length() -> None:
    # Two running tasks 10 s in, a quarter written: each takes 40 s, so 30 s more; the two
    # partitions not started then take 40 s on the two slots.
    assert time_left([task(10.0, 0.25), task(10.0, 0.25)], 4, 2, NOW) == pytest.approx(70.0)


def test_tasks_that_ended_set_a_task_s_length_and_waves_are_counted() -> None:
    # Two ended after 30 s; two more started 10 s ago: 20 s left of them, then none queued.
    tasks = [task(40.0, took=30.0), task(40.0, took=30.0), task(10.0, 0.1), task(10.0, 0.1)]
    assert time_left(tasks, 4, 2, NOW) == pytest.approx(20.0)
    # With six partitions, the fifth and sixth follow on the slots the running ones free.
    assert time_left(tasks, 6, 2, NOW) == pytest.approx(50.0)
    # With one slot, the running tasks and the two after them run one at a time.
    assert time_left(tasks[:3], 5, 1, NOW) == pytest.approx(20.0 + 30.0 + 30.0)


def test_a_task_slower_than_the_others_has_what_its_own_share_says_left() -> None:
    tasks = [task(50.0, took=20.0), task(45.0, 0.9)]
    assert time_left(tasks, 2, 2, NOW) == pytest.approx(5.0)


def test_partitions_a_rerun_skipped_do_not_set_a_task_s_length() -> None:
    tasks = [task(20.0, took=0.1, skipped=True), task(20.0, took=0.1, skipped=True),
             task(10.0, 0.5), task(10.0, 0.5)]  # fmt: skip
    assert time_left(tasks, 4, 2, NOW) == pytest.approx(10.0)


def test_a_task_past_a_task_s_length_with_nothing_written_gives_no_estimate() -> None:
    # Three ended after 10 s; the fourth has run 15 s and written nothing yet: it may be taking
    # in a larger partition, so no time is said (not "0 s left").
    tasks = [task(30.0, took=10.0), task(30.0, took=10.0), task(20.0, took=10.0), task(15.0)]
    assert time_left(tasks, 4, 2, NOW) is None
    # Once it has written a third of its cells, its own share says the rest.
    tasks[-1] = task(15.0, 1 / 3)
    assert time_left(tasks, 4, 2, NOW) == pytest.approx(30.0)
