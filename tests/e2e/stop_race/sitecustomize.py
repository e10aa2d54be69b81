"""On PYTHONPATH for the stop tests: it makes Spark's streaming-source planner lose the race of a
stop every time. Spark stops the planner by closing its socket and sending it SIGTERM; when the
planner sees the socket closed first, it reports that (EOFError), fails to send the report
(BrokenPipeError) and prints both tracebacks, which the JVM passes on to its stderr (see
sluice.pipeline.jvm_stderr). Here the planner's SIGTERM shuts its sockets instead of killing it,
so that every stop takes that path, through PySpark's own code. Python imports this module at
start-up in every process that inherits the test's environment; it acts in the planner only."""

import os
import signal
import socket
import sys


def _shut_sockets(signum: int, frame: object) -> None:
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                with socket.socket(fileno=os.dup(int(fd))) as s:
                    s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


if "pyspark.sql.streaming.python_streaming_source_runner" in getattr(sys, "orig_argv", ()):
    signal.signal(signal.SIGTERM, _shut_sockets)
