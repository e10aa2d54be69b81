"""The JVM's stderr, passed on without the noise of processes dying in the wrong order.

A local Spark's JVM inherits this process's stderr, and so do the Python processes it starts:
the executors' workers and, for each streaming query on a Python data source, the source's
planner (`python_streaming_source_runner`). When a query stops, Spark closes the planner's
socket and then sends it SIGTERM. If the planner wakes first, it finds the socket closed
(`EOFError`), tries to report that on the same socket (`BrokenPipeError`) and prints both
tracebacks, which the JVM copies to its stderr. The same happens when Ctrl-C or a service
manager signals the whole process group and the JVM goes before its children. Nothing is wrong
in either case (the query was stopping), but a user sees three tracebacks on a clean stop, in
one stop out of some dozens, as the race falls.

`forward_jvm_stderr` starts the JVM with its stderr on a pipe, and a thread passes every line on
to this process's stderr except:

- a Python traceback that comes from a Spark worker or planner and ends in the errors of a
  peer going away (`EOFError`, `BrokenPipeError`, `ConnectionResetError`), and, once this
  process is stopping, one of PySpark's Python processes ending in KeyboardInterrupt (the
  signal to the process group reached it too, maybe while it was still importing);
- Spark's ERROR lines about a query that ended, once this process was asked to stop
  (`stopping`): a SIGTERM to the whole process group (systemd, `timeout`, `kill -- -PGID`)
  kills the planner in the middle of a call, and Spark reports that as an error of the query.
  So too a batch job's (an offline command's) tasks refused by pools already shut and its
  Python workers killed by the same signal, and a SparkContext whose making the signal cut
  short.
  Such lines are held for `HOLD_S` before they pass, so that the signal that caused them is
  seen first;
- likewise once stopping, a Java exception that escaped a query's stream thread (`Exception in
  thread "stream execution thread for ..."`, printed by the JVM with its stack) or that says
  Spark's RPC was already shut down: the JVM's shutdown hook stops the SparkContext while the
  stream thread is still winding down, and the thread's last call finds the RPC gone;
- Spark's ERROR line about a query whose batch failed with LeaseLost: a leader that lost its
  lease ends its batch so on purpose, and logs it itself, in one line (`fenced`);
- Spark's ERROR lines about a task or a query that Redis going away ended (a connection
  refused or timed out, a Redis loading its data): the supervisor says so itself, in one line,
  and waits for Redis (`redis_gone`);
- the JVM's start-up notice about incubator modules, and DataSketches' notice that on Java 17
  it works on the heap only;
- in a process that reports its batch jobs' failures itself (`batch_jobs`: the offline
  commands), Spark's ERROR lines about a failed task and the job it aborts, each a whole Java
  trace on one line, printed before the command's own one-line error; and, once a task failed,
  any other of Spark's ERROR lines: the job's other tasks, cancelled by its abort, report the
  blocks and broadcasts taken from under them (`Error occurred while fetching local blocks`,
  `Block broadcast_3 does not exist`). Spark's ERROR lines in such a process are held for
  `HOLD_S`, so that a failure reported just after them is seen first.

Any other line, tracebacks included, passes unchanged. A worker that fails for a real reason
reaches the query as an error, which Sluice reports itself; a batch cut short by a stop runs
again from the checkpoint on the next start.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sluice.logs import REDIS_GONE

# Where a traceback must come from to be dropped: Spark's own Python processes.
SPARK_PYTHON = ("pyspark/sql/streaming/python_streaming_source_runner", "pyspark/worker_util",
                "pyspark/daemon.py")  # fmt: skip
# What it must end in: the other end went away.
PEER_GONE = ("EOFError", "BrokenPipeError", "ConnectionResetError")
DROPPED_LINES = (
    "WARNING: Using incubator modules: jdk.incubator.vector",
    # DataSketches' memory library (Spark's KLL sketches, for `quantile`) on Java 17: it runs
    # on the heap, which is all Spark asks of it
    "Warning: Java versions > Java 11 can only operate in restricted mode where no off-heap"
    " operations are allowed!",
)
HEADER = "Traceback (most recent call last):"
CHAINS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# A Java exception the JVM prints for a thread that died of it, and its stack's lines.
JAVA_HEADER = 'Exception in thread "'
JAVA_STACK = ("\t", " ", "Caused by: ", "Suppressed: ")
# What makes such an exception the stop's (see `stopping`): where it escaped, or its cause.
STOP_MADE = ('Exception in thread "stream execution thread', "RpcEnvStoppedException")
# A traceback with no line after its error for this long is complete.
QUIET_S = 0.2
# Spark's report of a query that ended, or of a batch job's tasks cut off (their thread pools
# shut, their Python workers killed), which a stop makes (see `stopping`).
SPARK_ERROR = " level=ERROR logger=org.apache.spark"
STOP_REPORTS = (
    "terminated with error",
    "RejectedExecutionException",
    "rejected from java.util.concurrent",
    "Python worker exited unexpectedly",
    # a context still being made when the signal reached the JVM: its shutdown began first
    "Error initializing SparkContext",
    # a task's Python worker (or the daemon that forks them, still importing PySpark) that
    # the signal to the process group interrupted
    "KeyboardInterrupt",
)
HOLD_S = 0.5

# the error of a batch a deposed leader ended: another process holds the lease (any other
# LeaseLost, such as a lease that could not be read, passes with its traceback)
LEASE_LOST = "sluice.errors.LeaseLost: "
DEPOSED = "(another process holds it)"

# A failed task's report: the executor's error with its whole trace, and the job's abort.
TASK_FAILED = (
    ("logger=org.apache.spark.executor.Executor", "Exception in task"),
    ("logger=org.apache.spark.scheduler.TaskSetManager", "aborting job"),
)

_stop_requested: list[float] = []  # monotonic time of the stop request, once made
_batch: list[bool] = []  # set once: this process reports its batch jobs' failures itself
_failed: list[float] = []  # monotonic time of the first failed task's report, in such a process


def batch_jobs() -> None:
    """This process runs batch jobs and reports their failures itself, in a line of its own (the
    offline commands: the file Spark could not read, the write the store refused): a failed
    task's ERROR lines, its Java trace on one line, are not printed before it."""
    if not _batch:
        _batch.append(True)


def task_failed(line: str) -> bool:
    """Whether a line is Spark's report of a failed task or the job it aborts."""
    return SPARK_ERROR in line and any(a in line and b in line for a, b in TASK_FAILED)


def _failed_by(arrived: float) -> bool:
    return bool(_failed) and _failed[0] <= arrived + HOLD_S


def failure_made(line: str) -> bool:
    """Whether a line may be what a failed task's job abort makes Spark print, in a process that
    reports its batch jobs' failures itself: dropped if a task failed by `HOLD_S` after it."""
    return bool(_batch) and SPARK_ERROR in line


def stopping() -> None:
    """This process was asked to stop: Spark's reports of queries ending are the stop's from now
    on (and for `HOLD_S` before). Safe in a signal handler: it takes no lock."""
    if not _stop_requested:
        _stop_requested.append(time.monotonic())


def _stopped_by(arrived: float) -> bool:
    return bool(_stop_requested) and _stop_requested[0] <= arrived + HOLD_S


def fenced(line: str) -> bool:
    """Whether a line is Spark's report of a query that a deposed leader's batch ended on
    purpose (LeaseLost: Spark commits nothing), which the process logs itself as `leadership
    lost`, in one line; Spark's has the batch's whole Python traceback in it (3-7 KB)."""
    ended = SPARK_ERROR in line and "terminated with error" in line
    return ended and LEASE_LOST in line and DEPOSED in line


def redis_gone(line: str) -> bool:
    """Whether a line is Spark's report of a task or query that Redis going away ended."""
    return SPARK_ERROR in line and any(marker in line for marker in REDIS_GONE)


def query_ended(line: str) -> bool:
    """Whether a line (or a Java exception block, see `TracebackFilter`) is what a stop makes
    Spark print: dropped once this process is stopping."""
    if line.startswith(JAVA_HEADER):
        return any(marker in line for marker in STOP_MADE)
    return SPARK_ERROR in line and any(report in line for report in STOP_REPORTS)


def _exception_lines(block: list[str]) -> list[str]:
    return [
        line
        for line in block
        if line.strip() and not line[0].isspace() and line != HEADER and line not in CHAINS
    ]


def noise(block: list[str]) -> bool:
    """Whether a traceback (its lines, without newlines) is a Spark Python process finding its
    JVM gone, or, once this process is stopping, one of PySpark's own Python processes that the
    signal to the process group interrupted (it ends in KeyboardInterrupt, maybe while it was
    still importing)."""
    errors = _exception_lines(block)
    from_spark = any(any(where in line for where in SPARK_PYTHON) for line in block)
    if from_spark and errors and all(e.split(":", 1)[0].strip() in PEER_GONE for e in errors):
        return True
    interrupted = bool(errors) and errors[-1].strip() == "KeyboardInterrupt"
    return interrupted and bool(_stop_requested) and any("pyspark" in line for line in block)


class TracebackFilter:
    """Feed it lines (without newlines); it gives back the lines to pass on. A Python traceback
    is held until it is complete, then passed on whole or dropped whole (see `noise`). A Java
    exception block (`JAVA_HEADER` and its stack) is held too, and given back as one item, its
    lines joined by newlines, so that what follows can judge it whole (`query_ended`)."""

    def __init__(self) -> None:
        self._block: list[str] = []
        self._after_error = False  # the last non-blank line of the block is an error line
        self._java: list[str] = []

    @property
    def holding(self) -> bool:
        return bool(self._block or self._java)

    def feed(self, line: str) -> list[str]:
        if self._java:
            if line.startswith(JAVA_STACK):
                self._java.append(line)
                return []
            return self.flush() + self.feed(line)
        if not self._block:
            if line == HEADER:
                self._block = [line]
                return []
            if line.startswith(JAVA_HEADER):
                self._java = [line]
                return []
            failed = bool(_batch) and task_failed(line)
            if failed and not _failed:
                _failed.append(time.monotonic())
            dropped = line.strip() in DROPPED_LINES or failed or fenced(line) or redis_gone(line)
            return [] if dropped else [line]
        ends = self._after_error and line.strip() and line not in CHAINS and line != HEADER
        if ends:  # an error line followed by anything but a chained traceback
            return self.flush() + self.feed(line)
        self._block.append(line)
        if line in CHAINS or line == HEADER:
            self._after_error = False
        elif line.strip() and not line[0].isspace():
            self._after_error = True
        return []

    def flush(self) -> list[str]:
        """End the block held (if any): a traceback's lines, or none if it is noise; a Java
        exception as one item."""
        if self._java:
            java, self._java = self._java, []
            return ["\n".join(java)]
        block, self._block, self._after_error = self._block, [], False
        return [] if not block or noise(block) else block


def pump(read_fd: int, write: Callable[[bytes], None]) -> None:
    """Pass lines from `read_fd` to `write` through a `TracebackFilter`, until end of file.
    Spark's reports of a query that ended wait `HOLD_S` (see `stopping`), as do a batch
    command's Spark ERROR lines (see `failure_made`), and the lines after them wait with them,
    to keep their order."""
    lines = TracebackFilter()
    # (arrival, line, whether a stop drops it, whether a failed task drops it)
    held: list[tuple[float, str, bool, bool]] = []
    pending = b""
    last = time.monotonic()  # when the last chunk came

    def release(until: float) -> None:
        out = []
        while held and held[0][0] + HOLD_S <= until:
            arrived, line, by_stop, by_failure = held.pop(0)
            stopped, failed = by_stop and _stopped_by(arrived), by_failure and _failed_by(arrived)
            if not (stopped or failed):
                out.append(line)
        _write_lines(write, out)

    def emit(passed: list[str], arrived: float) -> None:
        out = []
        for line in passed:
            by_stop, by_failure = query_ended(line), failure_made(line)
            if by_stop or by_failure or held:
                held.append((arrived, line, by_stop, by_failure))
            else:
                out.append(line)
        _write_lines(write, out)

    while True:
        now = time.monotonic()
        release(now)
        waits = [held[0][0] + HOLD_S - now] if held else []
        if lines.holding and not pending:
            waits.append(last + QUIET_S - now)
        if waits:
            ready, _, _ = select.select([read_fd], [], [], max(0.0, min(waits)))
            if not ready:
                if lines.holding and time.monotonic() >= last + QUIET_S:
                    emit(lines.flush(), last)  # the traceback is complete
                continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        last = time.monotonic()
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            emit(lines.feed(raw.decode("utf-8", "replace")), last)
    tail = [*lines.feed(pending.decode("utf-8", "replace"))] if pending else []
    emit([*tail, *lines.flush()], last)
    release(float("inf"))


def _write_lines(write: Callable[[bytes], None], lines: list[str]) -> None:
    if lines:
        write("".join(line + "\n" for line in lines).encode("utf-8", "replace"))


@contextmanager
def forward_jvm_stderr() -> Iterator[None]:
    """Within the block, processes started get a pipe as their stderr (fd 2), passed on to this
    process's stderr by a daemon thread through `TracebackFilter`. This process's own writes to
    fd 2 in the block take the same way. Meant around the call that launches the JVM."""
    try:
        target = os.dup(2)
    except OSError:  # no stderr at all: nothing to pass on
        yield
        return
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def write(data: bytes) -> None:
        try:
            while data:
                data = data[os.write(target, data) :]
        except OSError:
            pass  # whoever read our stderr is gone; the JVM's lines go with it

    threading.Thread(target=pump, args=(read_fd, write), name="jvm-stderr", daemon=True).start()
    try:
        yield
    finally:
        os.dup2(target, 2)  # the JVM keeps the pipe; this process writes to its stderr again
