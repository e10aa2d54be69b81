"""The Spark session Sluice runs in."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from pyspark import SparkContext
from pyspark.sql import SparkSession

from sluice.config import Config
from sluice.logs import SPARK_LOG_LEVEL_ENV
from sluice.pipeline.cds import java_options
from sluice.pipeline.jvm import CLASSPATH_KEY, local_fs_conf
from sluice.pipeline.jvm_stderr import forward_jvm_stderr
from sluice.pipeline.ship import is_local, package_zip

log = logging.getLogger(__name__)


# The driver's thread stack. When a foreachBatch call fails, Spark tells a stop from an error by
# matching the error's text with a regex that recurses once per character
# (`StreamExecution.PROXY_ERROR`); with the JVM's default 1 MB stack, a text past a few thousand
# characters (a Java stack trace in a Python traceback, as a stop mid-batch makes) overflows it,
# and the stream thread dies of a StackOverflowError instead of stopping or reporting the error.
# A frame per character takes up to about 600 bytes while the regex still runs interpreted (a JVM
# that has not compiled it yet, as on a busy machine), so 16 MB failed at 30,000 characters there;
# 64 MB holds about 100,000 even then. Stacks are reserved, not resident, until used.
DRIVER_THREAD_STACK = "64m"
# Spark skips its per-row size check of Arrow batches when the byte bound is exactly this.
ARROW_NO_BYTE_BOUND = 2**31 - 1
# Metrics' `value` and `filter` expressions are evaluated as Spark SQL did before its ANSI mode:
# a division by zero gives null for that event, which then does not count for the metric, as any
# null value; an integer overflow wraps, as Java's arithmetic does. Under ANSI mode one such event
# fails its whole batch, again on every retry. The live fold's session has this from the start,
# whatever `spark.conf` says (`build_spark`); the offline entry points set it for the plans they
# build on a session their caller brings (`expression_semantics`), so that both fold the same
# events the same way. Times without a zone (a `timestamp_ntz` column, ISO 8601 text with no
# offset) are read as UTC, whatever zone the caller's session is in.
EXPRESSION_CONF = {"spark.sql.ansi.enabled": "false", "spark.sql.session.timeZone": "UTC"}

P = ParamSpec("P")
R = TypeVar("R")


def expression_semantics(
    fn: Callable[Concatenate[SparkSession, P], R],
) -> Callable[Concatenate[SparkSession, P], R]:
    """Run `fn(spark, ...)` with EXPRESSION_CONF set on `spark`, and the caller's values back
    after it. A DataFrame keeps the semantics it was planned with, so one that `fn` returns
    runs the same later. Calls that overlap on one session (threads, or one such call inside
    another) share the setting: the first sets it and the last gives the caller's values back,
    so none plans under the caller's values while another still runs."""

    @functools.wraps(fn)
    def wrapper(spark: SparkSession, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with _SEMANTICS_LOCK:
            held = _SEMANTICS_HELD.get(id(spark))
            if held is None:
                callers = {k: spark.conf.get(k, None) for k in EXPRESSION_CONF}
                held = _SEMANTICS_HELD[id(spark)] = [0, callers]
                for k, v in EXPRESSION_CONF.items():
                    spark.conf.set(k, v)
            held[0] += 1
        try:
            return fn(spark, *args, **kwargs)
        finally:
            with _SEMANTICS_LOCK:
                held[0] -= 1
                if not held[0]:
                    del _SEMANTICS_HELD[id(spark)]
                    for k, old in held[1].items():
                        if old is None:
                            spark.conf.unset(k)
                        else:
                            spark.conf.set(k, old)

    return wrapper


# Per session (by id) that `expression_semantics` calls run on: [calls running, caller's values].
_SEMANTICS_HELD: dict[int, list[Any]] = {}
_SEMANTICS_LOCK = threading.Lock()


def quiet_query_contexts() -> None:
    """PySpark logs every SQL error it converts, with the JVM's whole stack, on loggers of its
    own (a JSON line of kilobytes on stderr), before the caller sees the error. Sluice turns
    each one it expects (a bad `value` or `filter`, a bad spine column) into a message of its
    own, and any other reaches the user as the error itself: these loggers say nothing more."""
    from pyspark.logger import PySparkLogger

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)


def build_spark(cfg: Config, app_name: str = "sluice", sources: bool = True) -> SparkSession:
    """Create (or join) the session for `cfg.spark`. Spark's own logs go to stderr as key=value
    lines at SLUICE_SPARK_LOG_LEVEL (default ERROR), so its INFO and WARN chatter stays out.

    The master is `spark.master`, unless this process was launched by `spark-submit`, whose
    `--master` then wins. On any master but a local one, Sluice's own code is shipped to the
    executors (see `sluice.pipeline.ship`). A local Spark that this call starts writes its
    checkpoint logs without a child process per file (see `sluice.pipeline.jvm`). A JVM that this
    call starts has its stderr passed on without the tracebacks of a clean stop (see
    `sluice.pipeline.jvm_stderr`). With `sources`, the log's streaming source and its warm-up
    are registered (about a second each, as PySpark pickles each class with what it refers
    to); batch jobs over files need neither.
    """
    # Executors run this interpreter unless `spark.pyspark.python` says otherwise (a cluster
    # whose workers keep Python elsewhere sets it in `spark.conf`).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM
    local = not submitted and is_local(cfg.spark.master)
    if local:
        # Keep a local Spark on loopback: nothing of it should listen on other interfaces.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.shuffle.partitions", str(cfg.spark.shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
        # Batches to Python tasks (`mapInArrow`) are bounded by rows (maxRecordsPerBatch,
        # 10,000) only: with a byte bound Spark measures the batch after every row it adds, a
        # fifth of the JVM's time in a training set's pass over the archive.
        .config("spark.sql.execution.arrow.maxBytesPerBatch", str(ARROW_NO_BYTE_BOUND))
    )
    if not submitted:
        builder = builder.master(cfg.spark.master)
    if local:
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    level = os.environ.get(SPARK_LOG_LEVEL_ENV, "ERROR").upper()
    fs_conf = local_fs_conf(cfg.spark.conf) if local else {}  # checkpoint writes without chmod
    for k, v in fs_conf.items():
        builder = builder.config(k, v)
    if "spark.driver.extraJavaOptions" not in cfg.spark.conf:
        # Quiet from the JVM's first line: the default profile prints INFO and WARN lines
        # before setLogLevel can act. Only takes effect when this call starts the JVM, as do
        # the class archive's options (sluice.pipeline.cds).
        props = resources.files("sluice.pipeline") / "log4j2.properties"
        starts_jvm = local and SparkContext._gateway is None
        classpath = cfg.spark.conf.get(CLASSPATH_KEY) or fs_conf.get(CLASSPATH_KEY)
        archive = java_options(classpath) if starts_jvm else ""
        builder = builder.config(
            "spark.driver.extraJavaOptions",
            f"-Dlog4j2.configurationFile={props} -Dsluice.spark.logLevel={level}"
            f" -Xss{DRIVER_THREAD_STACK} {archive}".rstrip(),
        )
    for k, v in {**cfg.spark.conf, **EXPRESSION_CONF}.items():
        builder = builder.config(k, v)
    if submitted or SparkContext._gateway is not None:
        spark = builder.getOrCreate()  # the JVM runs already: its stderr is what it is
    else:
        with forward_jvm_stderr():  # launches the JVM (see sluice.pipeline.jvm_stderr)
            spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(level)
    quiet_query_contexts()
    master = spark.sparkContext.master or cfg.spark.master
    if not is_local(master):
        shipped = package_zip(Path(cfg.state_dir) / "dist")
        spark.sparkContext.addPyFile(str(shipped))
        log.info("spark cluster", extra={"master": master, "shipped": shipped.name})
    if sources:
        from sluice.source.reader import LogDataSource
        from sluice.source.warm import WarmUpSource

        spark.dataSource.register(LogDataSource)
        spark.dataSource.register(WarmUpSource)
    return spark
