"""Write-behind: a fold writes batch N while Spark reads and folds batch N+1.

A batch's Spark job reads, decodes and folds; its write then waits on Redis while the cores the
fold used sit idle. With write-behind (`spark.write_behind`) the fold collects a batch's folded
updates to the driver and returns at once; a writer thread writes them, audits the batch,
records it and only then releases its input, while Spark commits the batch and runs the next.

What keeps this exactly-once:

- **One batch behind, in order.** A batch starts its own write only after the previous batch's
  write, audit and record finished (`WriteBehind.wait`), and returns only once its write began:
  at most one committed batch is ever unwritten, the newest, and batches reach the store in
  order (the slice script skips an update whose token is older than the stored one, so order
  matters).
- **The input stays until the write is done.** The source does not release a batch's entries
  when Spark commits it (`SourceOptions.release`); the fold does, after the write balanced.
- **A mark per written batch.** `<checkpoint>/sluice-written` holds the newest batch whose
  write, audit and record finished (written before its release). On start, a committed batch
  newer than the mark is un-committed (`replay_unwritten`): its commit-log entry and the next
  batch's offset-log entry go, so Spark runs it again from its logged offsets, with the same
  writer token (idempotent: what the lost attempt wrote is skipped).
- **A written batch is not run twice.** The writer thread may finish a batch (mark, release)
  before Spark writes its commit; a query that ends in between leaves it uncommitted, and Spark
  runs it again from its offset log. Its input is gone, so the fold skips a batch at or below
  the mark it read at start (`FoldQuery.process_batch`): its write, audit and record are done.
- **A failed write fails the next batch.** A write or audit that fails in the thread is raised
  by the next batch (which then commits nothing) or, when no batch comes, stops the query from
  the fold's monitor thread; either way the restart replays the unwritten batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from sluice.config import Config
from sluice.errors import PipelineError
from sluice.files import read_text, replace_text
from sluice.pipeline.audit import logged_batches
from sluice.pipeline.ship import is_local

log = logging.getLogger(__name__)

MARK_FILE = "sluice-written"


def write_behind(cfg: Config, spark: SparkSession) -> bool:
    """Whether a fold writes behind (`spark.write_behind`; `auto`: on a local master, where the
    driver is on the executors' machine; on a cluster the executors write)."""
    mode = cfg.spark.write_behind
    if mode == "auto":
        return is_local(spark.sparkContext.master or cfg.spark.master)
    return mode == "on"


def describe(err: BaseException) -> str:
    """An error's first line, for a log record."""
    text = str(err)
    return text.splitlines()[0] if text else repr(err)


def read_mark(ckpt: Path) -> int | None:
    """The newest batch known written, or None when the checkpoint has no mark yet."""
    text = read_text(ckpt / MARK_FILE)
    return None if text is None else int(text.strip())


def write_mark(ckpt: Path, batch_id: int) -> None:
    """Mark `batch_id` written (atomically: a crash leaves the old mark or the new one)."""
    replace_text(ckpt / MARK_FILE, str(batch_id))


def _drop(ckpt: Path, log_name: str, batch_id: int) -> None:
    for name in (str(batch_id), f".{batch_id}.crc"):
        (ckpt / log_name / name).unlink(missing_ok=True)


def replay_unwritten(ckpt: Path) -> int | None:
    """Before the query starts: un-commit the committed batch whose write did not finish (see
    the module docstring), so that Spark runs it again. Returns its id, or None when every
    committed batch was written. A checkpoint without a mark (new, or from a fold that wrote
    every batch before committing it) gets one at its newest committed batch."""
    commits = logged_batches(ckpt, "commits")
    newest = commits[-1] if commits else -1
    mark = read_mark(ckpt)
    if mark is None or mark >= newest:
        if mark is None:
            write_mark(ckpt, newest)
        return None
    if newest > mark + 1:  # at most one batch is ever behind; anything else is not ours
        raise PipelineError(
            f"checkpoint {ckpt}: batches {mark + 1}..{newest} are committed but batch {mark} is"
            " the newest written; only one batch can be behind. Was the mark file"
            f" {MARK_FILE} replaced? Removing it accepts every committed batch as written."
        )
    for later in logged_batches(ckpt, "offsets"):
        if later > newest:
            _drop(ckpt, "offsets", later)
    _drop(ckpt, "commits", newest)
    log.warning(
        "a committed batch was not written: it runs again",
        extra={"batch": newest, "checkpoint": str(ckpt)},
    )
    return newest


class WriteBehind:
    """The writer thread and the one write in flight."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"sluice-write-{name}")
        self._pending: Future[Any] | None = None

    def submit(self, write: Callable[[], Any]) -> None:
        """Start `write` in the thread; the previous write must have been waited for."""
        assert self._pending is None or self._pending.done(), "one write behind at most"
        self._pending = self._pool.submit(write)

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise what it raised. The write stays in flight
        for `settle` and `idle` until it is done: a batch waiting here may be abandoned (its
        query stopped), and the next start must still wait for the write."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if self._pending is pending:
                self._pending = None

    def settle(self) -> BaseException | None:
        """Wait for the write in flight and return its failure instead of raising it (the
        restart replays the batch)."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return e
        return None

    @property
    def idle(self) -> bool:
        return self._pending is None or self._pending.done()

    def failed(self) -> BaseException | None:
        """The failure of a finished write not yet waited for, without waiting."""
        p = self._pending
        if p is None or not p.done():
            return None
        return p.exception()
