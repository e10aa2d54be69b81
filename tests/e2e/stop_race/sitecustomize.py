"""On PYTHONPATH for the stop tests: it makes Spark's streaming-source planner lose the race of a
stop every time. Spark stops the planner by closing its socket and sending it SIGTERM; when the
planner sees the socket closed first, it reports that (EOFError), fails to send the report
(BrokenPipeError) and prints both tracebacks, which the JVM passes on to its stderr (see
sluice.pipeline.jvm_stderr). Here the planner's SIGTERM shuts its socket to the JVM instead of
killing it, so that every stop takes that path, through PySpark's own code. Python imports this
module at start-up in every process that inherits the test's environment; it acts in the
planner only."""

import os
import signal
import socket
import sys


def _to_the_jvm(s: socket.socket) -> bool:
    """Whether `s` is the planner's connection to the JVM (its other sockets, such as the
    source's Redis connections, stay up in a real stop, and here too)."""
    if s.family == socket.AF_UNIX:
        return "PYTHON_WORKER_FACTORY_SOCK_PATH" in os.environ
    port = int(os.environ.get("PYTHON_WORKER_FACTORY_PORT", "-1"))
    try:
        return s.getpeername()[1] == port
    except OSError:
        return False


def _shut_sockets(signum: int, frame: object) -> None:
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                with socket.socket(fileno=os.dup(int(fd))) as s:
                    if _to_the_jvm(s):
                        s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


if "pyspark.sql.streaming.python_streaming_source_runner" in getattr(sys, "orig_argv", ()):
    signal.signal(signal.SIGTERM, _shut_sockets)
