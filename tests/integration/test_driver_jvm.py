"""The driver JVM that `build_spark` starts (the shared session): its threads' stack is large
enough for Spark to classify a long foreachBatch error, so a stop mid-batch or a failed batch
ends the query cleanly instead of killing its thread with a StackOverflowError."""

from __future__ import annotations

from typing import Any

from sluice.pipeline.spark import ARROW_NO_BYTE_BOUND, DRIVER_THREAD_STACK

# A Python traceback that holds a Java one, as a foreachBatch call interrupted by a stop sends
# back to Spark: a few hundred frames are tens of thousands of characters.
FRAME = "\tat org.apache.spark.scheduler.DAGScheduler.runJob(DAGScheduler.scala:1000)\n"
PREFIX = "py4j.protocol.Py4JJavaError: An error occurred while calling o42.collect.\n"


def _stream_execution(spark: Any) -> Any:
    return spark._jvm.org.apache.spark.sql.execution.streaming.runtime.StreamExecution


def test_the_driver_threads_get_the_larger_stack(spark: Any) -> None:
    args = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
    assert f"-Xss{DRIVER_THREAD_STACK}" in list(args)


def test_spark_tells_a_long_interrupted_batch_error_from_a_failure(spark: Any) -> None:
    # Spark matches the text with a regex that recurses once per character; on the JVM's
    # default 1 MB stack this text overflows it (about 1,700 characters do).
    trace = FRAME * (30_000 // len(FRAME))
    sc = spark.sparkContext._jsc.sc()
    stop = spark._jvm.py4j.Py4JException(PREFIX + trace + ": java.lang.InterruptedException")
    failure = spark._jvm.py4j.Py4JException(PREFIX + trace + ": java.lang.IllegalStateException")
    assert len(PREFIX + trace) > 25_000
    assert _stream_execution(spark).isInterruptionException(stop, sc)
    assert not _stream_execution(spark).isInterruptionException(failure, sc)


def test_arrow_batches_to_python_are_bounded_by_rows_only(spark: Any) -> None:
    """With exactly this byte bound Spark does not measure a batch after every row it adds
    (`ARROW_NO_BYTE_BOUND`); the row bound keeps batches small."""
    assert spark.conf.get("spark.sql.execution.arrow.maxBytesPerBatch") == str(ARROW_NO_BYTE_BOUND)
    assert int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")) == 10_000
