"""The JVM's stderr filter and the stop signals: what a clean stop prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sluice.commands import StopSignals
from sluice.pipeline import jvm_stderr
from sluice.pipeline.jvm_stderr import TracebackFilter, noise, query_ended

ZIP = "/venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark"
# What Spark's streaming-source planner printed in a CI run when a Ctrl-C stop closed its socket
# before it got SIGTERM.
PLANNER_GONE = f"""\
Traceback (most recent call last):
  File "{ZIP}/sql/streaming/python_streaming_source_runner.py", line 265, in main
  File "{ZIP}/serializers.py", line 604, in read_int
EOFError

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "{ZIP}/worker_util.py", line 253, in get_sock_file_to_executor
  File "{ZIP}/sql/streaming/python_streaming_source_runner.py", line 299, in main
  File "/usr/lib/python3.11/socket.py", line 724, in write
    return self._sock.send(b)
           ^^^^^^^^^^^^^^^^^^
BrokenPipeError: [Errno 32] Broken pipe

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{ZIP}/sql/streaming/python_streaming_source_runner.py", line 313, in <module>
  File "{ZIP}/worker_util.py", line 255, in get_sock_file_to_executor
    return self._sock.send(b)
           ^^^^^^^^^^^^^^^^^^
BrokenPipeError: [Errno 32] Broken pipe
""".splitlines()

A_REAL_ERROR = f"""\
Traceback (most recent call last):
  File "{ZIP}/sql/streaming/python_streaming_source_runner.py", line 265, in main
  File "/app/sluice/source/reader.py", line 80, in latestOffset
ValueError: bad offset 'x'
""".splitlines()

LOG = 'ts=2026-11-28T21:26:29.532Z level=INFO logger=sluice msg="stopping after the batch"'


def _through(lines: list[str]) -> list[str]:
    f = TracebackFilter()
    out = [passed for line in lines for passed in f.feed(line)]
    return out + f.flush()


def test_the_planner_finding_its_jvm_gone_is_dropped_whole() -> None:
    assert noise(PLANNER_GONE)
    assert _through([LOG, *PLANNER_GONE, LOG]) == [LOG, LOG]


def test_other_tracebacks_and_lines_pass_unchanged() -> None:
    assert not noise(A_REAL_ERROR)
    assert _through([LOG, *A_REAL_ERROR, LOG]) == [LOG, *A_REAL_ERROR, LOG]
    ours = ["Traceback (most recent call last):", '  File "x.py", line 1', "EOFError"]
    assert _through(ours) == ours  # an EOFError that is not Spark's own processes'
    # A traceback cut off by a line that is no part of it ends there; both pass.
    cut = [*A_REAL_ERROR, "  indented, after the error", LOG]
    assert _through(cut) == cut


def test_spark_reporting_a_deposed_leader_s_query_is_dropped_and_other_errors_pass() -> None:
    """Spark's report, on one line, of a query whose batch a deposed leader failed on purpose
    (the process logs `leadership lost` itself); the same report of any other error passes."""
    head = (
        "ts=2026-12-03T12:32:41.712Z level=ERROR logger=org.apache.spark.sql.execution."
        'streaming.runtime.MicroBatchExecution msg="Query sluice [id = e3d6] terminated'
        ' with error" exc="org.apache.spark.sql.execution.streaming.sources.ForeachBatch'
        'UserFuncException: Traceback (most recent call last):\\n  File \\"lease.py\\"'
    )
    lost = " line 372\\nsluice.errors.LeaseLost: query `spark` lost its leadership lease"
    fenced = head + lost + ' (another process holds it); standing by"'
    unread = head + lost + ' (could not read it: Timeout); standing by"'  # no `lost` logged
    other = head + ' line 9\\nredis.exceptions.ResponseError: WRONGTYPE"'
    assert _through([LOG, fenced, LOG]) == [LOG, LOG]
    assert _through([LOG, unread, LOG]) == [LOG, unread, LOG]
    assert _through([LOG, other, LOG]) == [LOG, other, LOG]


def test_the_jvm_incubator_and_sketch_memory_notices_are_dropped() -> None:
    notice = "WARNING: Using incubator modules: jdk.incubator.vector"
    sketches = ("Warning: Java versions > Java 11 can only operate in restricted mode where no"
                " off-heap operations are allowed!")  # fmt: skip
    assert _through([notice, LOG, sketches]) == [LOG]


def _run_child(code: str, stop_first: bool, batch: bool = False) -> str:
    """A child process stands in for the JVM: it inherits the pipe as its stderr. `batch`: this
    process reports its batch jobs' failures itself (`batch_jobs`)."""
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from sluice.pipeline import jvm_stderr
        if {stop_first}:
            jvm_stderr.stopping()
        if {batch}:
            jvm_stderr.batch_jobs()
        with jvm_stderr.forward_jvm_stderr():
            child = subprocess.Popen([sys.executable, "-c", {code!r}])
        child.wait()
        print("ours, after", file=sys.stderr, flush=True)
        time.sleep(jvm_stderr.HOLD_S + jvm_stderr.QUIET_S + 0.5)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_child_process_stderr_goes_through_the_filter() -> None:
    text = "\n".join([LOG, *PLANNER_GONE, LOG]) + "\n"
    code = f"import sys; sys.stderr.write({text!r})"
    err = _run_child(code, stop_first=False)
    assert "Traceback" not in err
    assert err.count(LOG) == 2 and "ours, after" in err


QUERY_ENDED = (
    "ts=2026-11-28T21:48:33.516Z level=ERROR logger=org.apache.spark.sql.execution.streaming."
    'runtime.MicroBatchExecution msg="Query sluice [id = f2d8] terminated with error" '
    'exc="java.io.EOFException"'
)


# What `sluice backfill` printed on Ctrl-C: its tasks refused and its Python workers killed.
TASKS_CUT_OFF = [
    "ts=2026-11-30T15:48:54.879Z level=ERROR logger=org.apache.spark.scheduler.TaskSchedulerImpl"
    ' msg="Exception in statusUpdate" exc="java.util.concurrent.RejectedExecutionException: Task'
    " org.apache.spark.scheduler.TaskResultGetter$$anon$3@5798b137 rejected from"
    ' java.util.concurrent.ThreadPoolExecutor@57041685[Terminated, pool size = 0]"',
    "ts=2026-11-30T15:48:54.975Z level=ERROR logger=org.apache.spark.executor.Executor"
    ' msg="Exception in task 1.0 in stage 2.0 (TID 3): Python worker exited unexpectedly'
    ' (crashed)."',
    # Ctrl-C to the group as a streaming batch's task started its Python daemon (cut down)
    "ts=2026-12-03T18:40:12.365Z level=ERROR logger=org.apache.spark.executor.Executor"
    ' msg="Exception in task 0.0 in stage 0.0 (TID 0): \\nError from python worker:\\n'
    "  Traceback (most recent call last):\\n  KeyboardInterrupt\\nPYTHONPATH was:\\n"
    "  /v/pyspark.zip"
    "\\norg.apache.spark.SparkException: EOFException occurred while reading the port number"
    " from pyspark.daemon's stdout.\"",
]


TASK_FAILED = [
    "ts=2026-11-30T15:43:33.002Z level=ERROR logger=org.apache.spark.executor.Executor"
    ' msg="Exception in task 1.0 in stage 1.0 (TID 2)" exc="org.apache.spark.SparkException:'
    " [FAILED_READ_FILE.NO_HINT] Encountered error while reading file file:///a/b.parquet.\\n"
    '\\tat org.apache.spark.sql.errors.QueryExecutionErrors$.cannotReadFilesError"',
    "ts=2026-11-30T15:43:33.113Z level=ERROR logger=org.apache.spark.scheduler.TaskSetManager"
    ' msg="Task 1 in stage 1.0 failed 1 times; aborting job"',
]


@pytest.mark.parametrize("batch", [True, False])
def test_a_failed_task_s_trace_is_left_to_a_batch_command_s_own_error(batch: bool) -> None:
    code = f"import sys; sys.stderr.write({chr(10).join([*TASK_FAILED, LOG]) + chr(10)!r})"
    err = _run_child(code, stop_first=False, batch=batch)
    assert all((line in err) is not batch for line in TASK_FAILED), err
    assert LOG in err


# What `sluice backfill` printed in a CI run when its write task failed (Redis out of memory): the
# job's other tasks, cancelled, found their blocks gone (cut down).
TASKS_CANCELLED = [
    "ts=2026-12-03T20:59:27.186Z level=ERROR logger=org.apache.spark.storage."
    'ShuffleBlockFetcherIterator msg="Error occurred while fetching local blocks, null"',
    "ts=2026-12-03T20:59:27.369Z level=ERROR logger=org.apache.spark.TaskContextImpl"
    ' msg="Error in TaskCompletionListener" exc="org.apache.spark.SparkException:'
    " [INTERNAL_ERROR_STORAGE] Block broadcast_3 does not exist. SQLSTATE: XX000\\n\\tat"
    ' org.apache.spark.SparkException$.internalError(SparkException.scala:104)"',
]


@pytest.mark.parametrize("order", ["failure first", "failure after", "no failure", "streaming"])
def test_a_batch_job_s_tasks_cancelled_by_its_failure_are_dropped_with_it(order: str) -> None:
    """Only in a batch command (`batch_jobs`), only when a task failed, before the lines or up
    to `HOLD_S` after them; the lines after them pass, in order."""
    both = {"failure first": [*TASK_FAILED, *TASKS_CANCELLED],
            "failure after": [*TASKS_CANCELLED, *TASK_FAILED]}  # fmt: skip
    lines = both.get(order, TASKS_CANCELLED)
    text = "\n".join([*lines, LOG]) + "\n"
    err = _run_child(f"import sys; sys.stderr.write({text!r})", False, order != "streaming")
    dropped = order.startswith("failure")
    assert all((line in err) is not dropped for line in TASKS_CANCELLED), err
    assert err.index(LOG) < err.index("ours, after"), err


@pytest.mark.parametrize("stop_first", [True, False])
def test_a_batch_job_s_tasks_cut_off_by_a_stop_are_dropped_only_when_stopping(
    stop_first: bool,
) -> None:
    text = "\n".join([*TASKS_CUT_OFF, LOG]) + "\n"
    err = _run_child(f"import sys; sys.stderr.write({text!r})", stop_first=stop_first)
    assert all((line in err) is not stop_first for line in TASKS_CUT_OFF), err
    assert LOG in err


@pytest.mark.parametrize("stop_first", [True, False])
def test_spark_reporting_a_query_ended_is_dropped_only_when_stopping(stop_first: bool) -> None:
    code = f"import sys; sys.stderr.write({QUERY_ENDED + chr(10) + LOG + chr(10)!r})"
    err = _run_child(code, stop_first=stop_first)
    assert (QUERY_ENDED in err) is not stop_first, err
    assert LOG in err  # the line after it waited with it, and passed


# What a CI run printed when Ctrl-C to the process group reached a Python process Spark was
# starting, still importing PySpark (cut down), and what a SparkContext cut short by it logs.
INTERRUPTED_IMPORT = [
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 189, in _run_module_as_main',
    '  File "/v/site-packages/pyspark/python/lib/pyspark.zip/pyspark/__init__.py", line 129, in'
    " <module>",
    '  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load',
    "KeyboardInterrupt",
]
CONTEXT_CUT_SHORT = (
    'ts=2026-12-03T16:53:30.998Z level=ERROR logger=org.apache.spark.SparkContext msg="Error'
    ' initializing SparkContext." exc="java.lang.IllegalStateException: Shutdown hooks cannot be'
    ' modified during shutdown."'
)


@pytest.mark.parametrize("stop_first", [True, False])
def test_what_a_stop_interrupts_as_spark_starts_is_dropped_only_when_stopping(
    stop_first: bool,
) -> None:
    text = "\n".join([*INTERRUPTED_IMPORT, CONTEXT_CUT_SHORT, LOG]) + "\n"
    err = _run_child(f"import sys; sys.stderr.write({text!r})", stop_first=stop_first)
    assert ("KeyboardInterrupt" in err) is not stop_first, err
    assert ("Error initializing SparkContext" in err) is not stop_first, err
    assert LOG in err


# What a CI run printed after "stopped" when the JVM's shutdown hook stopped Spark's RPC while
# the stream thread was still ending (cut down: the stack had 10 more frames).
STREAM_THREAD_DIED = [
    'Exception in thread "stream execution thread for sluice [id = 4b1c, runId = 9e0a]" '
    "org.apache.spark.SparkException: Exception thrown in awaitResult: ",
    "\tat org.apache.spark.util.SparkThreadUtils$.awaitResult(SparkThreadUtils.scala:53)",
    "\tat org.apache.spark.sql.execution.streaming.state.StateStoreCoordinatorRef"
    ".deactivateInstances(StateStoreCoordinator.scala:196)",
    "Caused by: org.apache.spark.rpc.RpcEnvStoppedException: RpcEnv already stopped.",
    "\tat org.apache.spark.rpc.netty.Dispatcher.postMessage(Dispatcher.scala:179)",
    "\t... 8 more",
]


def test_a_java_exception_is_held_whole_and_passed_as_one_item() -> None:
    other = ['Exception in thread "main" java.lang.OutOfMemoryError: Java heap space', "\tat X.y"]
    out = _through([LOG, *STREAM_THREAD_DIED, *other, LOG])
    assert out == [LOG, "\n".join(STREAM_THREAD_DIED), "\n".join(other), LOG]
    assert query_ended(out[1]) and not query_ended(out[2]) and not query_ended(LOG)


@pytest.mark.parametrize("stop_first", [True, False])
def test_a_stream_thread_dying_of_the_stop_is_dropped_only_when_stopping(stop_first: bool) -> None:
    text = "\n".join([*STREAM_THREAD_DIED, LOG]) + "\n"
    err = _run_child(f"import sys; sys.stderr.write({text!r})", stop_first=stop_first)
    for line in STREAM_THREAD_DIED:
        assert (line in err) is not stop_first, err
    assert LOG in err


def test_a_signal_in_the_middle_of_the_stop_does_not_wait_for_it() -> None:
    """A second SIGTERM can come while the first one's stop holds a lock (`timeout` forwards
    one to the group): the handler takes none, so it cannot wait for itself."""
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        signals = StopSignals()
        calls: list[int] = []
        signals.then(lambda: calls.append(1))
        with signals.requested._cond:  # as if interrupted inside Event.set()
            signals._on_signal(signal.SIGTERM, None)
            signals._on_signal(signal.SIGTERM, None)
            assert signals.stopping
        assert signals.requested.wait(10)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert calls == [1]
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        jvm_stderr._stop_requested.clear()


def test_signals_to_a_process_in_a_row_stop_it_once() -> None:
    script = textwrap.dedent("""
        import os, signal, sys, time
        from sluice.commands import StopSignals
        from sluice.logs import setup_logging
        setup_logging("info")
        signals = StopSignals()
        stops = []
        signals.then(lambda: stops.append(1))
        print("ready", flush=True)
        for _ in range(50):
            os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested.wait(10)
        time.sleep(0.2)
        print("stops", len(stops), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "stops 1" in done.stdout
    assert done.stderr.count("stopping after the batch in flight") == 1, done.stderr


# A batch's task and its query ended by Redis going away (cut down), and one ended by an error
# reply, which is no outage and stays.
REDIS_WENT = [
    "ts=2026-12-03T18:48:56.976Z level=ERROR logger=org.apache.spark.executor.Executor"
    ' msg="Exception in task 0.0 in stage 10.0 (TID 12)" exc="org.apache.spark.api.python.'
    "PythonException: [PYTHON_EXCEPTION] An exception was thrown from the Python worker:"
    ' redis.exceptions.ConnectionError: Error 111 connecting to 127.0.0.1:19401."',
    "ts=2026-12-03T18:48:57.185Z level=ERROR logger=org.apache.spark.sql.execution.streaming."
    'runtime.MicroBatchExecution msg="Query sluice terminated with error" exc="... redis.'
    'exceptions.BusyLoadingError: Redis is loading the dataset in memory"',
]
WRONG_TYPE = (
    "ts=2026-12-03T18:48:56.976Z level=ERROR logger=org.apache.spark.executor.Executor"
    ' msg="Exception in task 0.0 in stage 10.0 (TID 12)" exc="... redis.exceptions.'
    'ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value"'
)


def test_spark_s_reports_of_redis_going_away_are_dropped_and_other_redis_errors_kept() -> None:
    text = "\n".join([*REDIS_WENT, WRONG_TYPE, LOG]) + "\n"
    err = _run_child(f"import sys; sys.stderr.write({text!r})", stop_first=False)
    assert not any(line in err for line in REDIS_WENT), err
    assert WRONG_TYPE in err and LOG in err


def test_py4j_s_report_of_a_batch_that_redis_going_away_ended_is_dropped() -> None:
    import logging

    import redis

    from sluice.logs import Handled

    def record(e: BaseException) -> logging.LogRecord:
        return logging.LogRecord("py4j.clientserver", logging.ERROR, "f", 1,
                                 "There was an exception while executing the Python Proxy", (),
                                 (type(e), e, None))  # fmt: skip

    handled = Handled()
    assert not handled.filter(record(redis.ConnectionError("Error 111 connecting")))
    in_task = RuntimeError("An error occurred while calling o93.collectToPython. ... redis."
                           "exceptions.TimeoutError: Timeout reading from socket")  # fmt: skip
    assert not handled.filter(record(in_task))
    stopped = RuntimeError(
        "An error occurred while calling o93.collectToPython.\n: java.lang.InterruptedException"
    )  # its query was being stopped
    assert not handled.filter(record(stopped))
    assert handled.filter(record(RuntimeError("the batch's own bug")))
