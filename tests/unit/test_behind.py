"""Write-behind's checkpoint bookkeeping (`pipeline.behind`): the written mark, and the
un-commit of the one committed batch whose write did not finish."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sluice.errors import PipelineError
from sluice.pipeline.behind import (
    MARK_FILE,
    WriteBehind,
    logged_batches,
    read_mark,
    replay_unwritten,
    write_mark,
)


def _checkpoint(root: Path, offsets: int, commits: int) -> Path:
    """A checkpoint whose logs hold batches 0..offsets-1 and 0..commits-1, with crc files."""
    for log_name, n in (("offsets", offsets), ("commits", commits)):
        (root / log_name).mkdir(parents=True)
        for b in range(n):
            (root / log_name / str(b)).write_text("v1\n{}\n{}\n")
            (root / log_name / f".{b}.crc").write_bytes(b"crc")
    return root


def test_a_checkpoint_without_a_mark_gets_one_at_its_newest_commit(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "c", offsets=4, commits=4)
    assert replay_unwritten(ckpt) is None
    assert read_mark(ckpt) == 3
    fresh = tmp_path / "fresh"
    assert replay_unwritten(fresh) is None and read_mark(fresh) == -1


def test_every_committed_batch_written_leaves_the_checkpoint_alone(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, offsets=5, commits=4)  # batch 4 planned, not committed
    write_mark(ckpt, 3)
    assert replay_unwritten(ckpt) is None
    assert logged_batches(ckpt, "offsets") == [0, 1, 2, 3, 4]
    assert logged_batches(ckpt, "commits") == [0, 1, 2, 3]


def test_the_unwritten_batch_is_uncommitted_and_the_next_plan_dropped(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, offsets=6, commits=5)  # batch 5 planned after 4 committed
    write_mark(ckpt, 3)  # batch 4's write did not finish
    assert replay_unwritten(ckpt) == 4
    assert logged_batches(ckpt, "commits") == [0, 1, 2, 3]
    assert logged_batches(ckpt, "offsets") == [0, 1, 2, 3, 4]  # Spark re-runs 4 from its log
    assert not (ckpt / "commits" / ".4.crc").exists()
    assert not (ckpt / "offsets" / ".5.crc").exists()
    assert replay_unwritten(ckpt) is None  # and again: nothing more to do


def test_more_than_one_batch_behind_is_refused(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, offsets=5, commits=5)
    write_mark(ckpt, 1)
    with pytest.raises(PipelineError, match="only one batch can be behind"):
        replay_unwritten(ckpt)
    assert logged_batches(ckpt, "commits") == [0, 1, 2, 3, 4]  # nothing was touched


def test_the_mark_is_replaced_whole(tmp_path: Path) -> None:
    write_mark(tmp_path, 7)
    write_mark(tmp_path, 8)
    assert read_mark(tmp_path) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARK_FILE]


def test_a_failed_write_is_raised_by_the_next_wait() -> None:
    wb = WriteBehind("t")
    wb.submit(lambda: 1 // 0)
    while not wb.idle:
        pass
    assert isinstance(wb.failed(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        wb.wait()
    assert wb.idle and wb.failed() is None
    wb.submit(lambda: None)
    assert wb.settle() is None


def test_a_write_waited_for_by_an_abandoned_batch_is_still_settled_by_the_next_start() -> None:
    """A batch blocked in `wait` whose query is stopped keeps waiting in its own thread; the
    restart's `settle` must still wait for the write before the unwritten batch is replayed."""
    wb = WriteBehind("t")
    release = threading.Event()
    wb.submit(lambda: release.wait(10))
    waiter = threading.Thread(target=wb.wait)
    waiter.start()
    waiter.join(0.1)  # blocked on the write
    assert waiter.is_alive() and not wb.idle
    settled: list[BaseException | None] = []
    settler = threading.Thread(target=lambda: settled.append(wb.settle()))
    settler.start()
    settler.join(0.2)
    assert settler.is_alive(), "settle returned while the write was still in flight"
    release.set()
    settler.join(5)
    waiter.join(5)
    assert settled == [None] and wb.idle
