"""The Spark session Sluice runs in."""

from __future__ import annotations

import logging
import os
import sys
from importlib import resources

from pyspark.sql import SparkSession

from sluice.config import Config
from sluice.logs import SPARK_LOG_LEVEL_ENV

log = logging.getLogger(__name__)


def build_spark(cfg: Config, app_name: str = "sluice") -> SparkSession:
    """Create (or join) the session for `cfg.spark`. Spark's own logs go to stderr as key=value
    lines at SLUICE_SPARK_LOG_LEVEL (default ERROR), so its INFO and WARN chatter stays out."""
    # Executors must run the same interpreter (and so see the same installed `sluice`).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = cfg.spark.master.startswith("local")
    if local:
        # Keep a local Spark on loopback: nothing of it should listen on other interfaces.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.appName(app_name)
        .master(cfg.spark.master)
        .config("spark.sql.shuffle.partitions", str(cfg.spark.shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if local:
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    level = os.environ.get(SPARK_LOG_LEVEL_ENV, "ERROR").upper()
    if "spark.driver.extraJavaOptions" not in cfg.spark.conf:
        # Quiet from the JVM's first line: the default profile prints INFO and WARN lines
        # before setLogLevel can act. Only takes effect when this call starts the JVM.
        props = resources.files("sluice.pipeline") / "log4j2.properties"
        builder = builder.config(
            "spark.driver.extraJavaOptions",
            f"-Dlog4j2.configurationFile={props} -Dsluice.spark.logLevel={level}",
        )
    for k, v in cfg.spark.conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(level)
    from sluice.source.reader import RedisStreamDataSource

    spark.dataSource.register(RedisStreamDataSource)
    return spark
