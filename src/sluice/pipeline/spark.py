"""The Spark session Sluice runs in."""

from __future__ import annotations

import logging
import os
import sys

from pyspark.sql import SparkSession

from sluice.config import Config

log = logging.getLogger(__name__)


def build_spark(cfg: Config, app_name: str = "sluice") -> SparkSession:
    """Create (or join) the session for `cfg.spark`. Quietens Spark's INFO logs."""
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
    for k, v in cfg.spark.conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("SLUICE_SPARK_LOG_LEVEL", "ERROR"))
    from sluice.source.reader import RedisStreamDataSource

    spark.dataSource.register(RedisStreamDataSource)
    return spark
