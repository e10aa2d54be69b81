"""The builder of the driver JVM's class archive (see `sluice.pipeline.cds`).

.venv/bin/python -m sluice.pipeline.cds_build     # what `make jvm-archive` runs
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from sluice.pipeline.cds import (
    ENV,
    HADOOP_LOCAL_FS,
    archive_inputs,
    archive_path,
    digest,
    failed_marker,
    inputs_file,
    lock_file,
    prune,
)
from sluice.pipeline.jvm import CLASSPATH_KEY, FS_KEY

BUILD_TIMEOUT_S = 600.0


def build(path: Path, extra_classpath: str | None) -> bool:
    """Write the archive at `path` (see the module docstring); True once it is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock_file(path).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another builder: wait for it
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return True
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            error = _run_and_exit(tmp, extra_classpath)
            if error is None and tmp.is_file() and tmp.stat().st_size > 0:
                record(path, extra_classpath)
                tmp.rename(path)
                failed_marker(path).unlink(missing_ok=True)
                _forget_dead_builds(path.parent)
                for gone in prune(path.parent, keep=path):
                    print(f"removed a class archive no environment uses now: {gone}")
                return True
            failed_marker(path).write_text(error or "the JVM wrote no archive\n")
            return False
        finally:
            tmp.unlink(missing_ok=True)


def record(path: Path, extra_classpath: str | None) -> None:
    """Write what the archive at `path` is made for beside it (`cds.prune` reads it), when
    `path` has the name those inputs give (not an archive written elsewhere with `--archive`)."""
    inputs = archive_inputs(extra_classpath)
    if inputs is not None and path.name == digest(inputs) and not inputs_file(path).exists():
        with contextlib.suppress(OSError):
            inputs_file(path).write_bytes(orjson.dumps(inputs))


def _forget_dead_builds(cache: Path) -> None:
    """Remove the half-written archives of builders that died (`.cds-<digest>.jsa.<pid>`).
    Archives for other JVMs, Sparks or environments stay: each is in use where it was made."""
    for tmp in cache.glob(".cds-*.jsa.*"):
        pid = tmp.name.rsplit(".", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def _run_and_exit(tmp: Path, extra_classpath: str | None) -> str | None:
    """Start Spark writing its classes to `tmp` at exit, run a little of everything, and let
    its JVM exit; None, or what went wrong."""
    from pyspark import SparkContext
    from pyspark.sql import functions as F

    from sluice.config import config_from_dict
    from sluice.pipeline.spark import build_spark

    os.environ[ENV] = f"dump:{tmp}"
    # The class path the archive is for, exactly: that jar, or none at all.
    conf = {CLASSPATH_KEY: extra_classpath} if extra_classpath else {FS_KEY: HADOOP_LOCAL_FS}
    cfg = config_from_dict({"metrics": [{"name": "n", "key": ["key"], "agg": "count"}],
                            "spark": {"conf": conf}})  # fmt: skip
    spark = build_spark(cfg, app_name="sluice-jvm-archive")
    proc = SparkContext._gateway.proc  # type: ignore[union-attr]
    try:
        df = spark.range(20_000).selectExpr(
            "id % 97 AS k", "id AS v", "CAST(id AS DOUBLE) * 1.5 AS d", "concat('c', id % 13) AS s"
        )
        df.groupBy("k", "s").agg(
            F.count("*"), F.sum("v"), F.max("d"), F.min("d"), F.approx_count_distinct("s")
        ).collect()
        df.mapInArrow(lambda batches: batches, df.schema).groupBy("k").count().collect()
        with tempfile.TemporaryDirectory() as d:
            df.write.parquet(f"{d}/p")
            back = spark.read.parquet(f"{d}/p")
            back.join(df.select("v", "k"), "v").groupBy("s").agg(F.sum("d")).toPandas()

            def batch(b: Any, _: int) -> None:
                b.mapInArrow(lambda x: x, b.schema).count()

            query = (
                spark.readStream.format("rate").option("rowsPerSecond", 1000).load()
                .writeStream.foreachBatch(batch)
                .option("checkpointLocation", f"{d}/ckpt")
                .trigger(processingTime="200 milliseconds")
                .start()
            )  # fmt: skip
            deadline = time.monotonic() + 120
            while int(dict(query.lastProgress or {}).get("batchId", -1)) < 2:
                if query.awaitTermination(1) or time.monotonic() > deadline:
                    break
            query.stop()
        error = None
    except Exception as e:  # noqa: BLE001 (an optimization: it says why, and never raises)
        error = f"the workload failed: {e}\n"
    finally:
        with contextlib.suppress(Exception):
            spark.stop()
        SparkContext._gateway.shutdown()  # type: ignore[union-attr]
        proc.stdin.close()  # the gateway exits on EOF, and the JVM writes the archive
    try:
        proc.wait(BUILD_TIMEOUT_S)  # in every case: the archive's file is written until then
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"the JVM did not exit within {BUILD_TIMEOUT_S:.0f} s\n"
    return error


def main() -> None:
    p = argparse.ArgumentParser(description="build the driver JVM's class archive")
    p.add_argument("--archive", type=Path, help="default: the one this machine's runs use")
    p.add_argument("--classpath", help="the extra class path (default: the local file system's)")
    p.add_argument("--background", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.background:
        os.nice(10)
    if os.environ.get(ENV) == "off":
        print("SLUICE_JVM_ARCHIVE=off: no class archive")
        return
    classpath = a.classpath
    if classpath is None:
        from sluice.pipeline.jvm import local_fs_conf

        classpath = local_fs_conf({}).get(CLASSPATH_KEY)
    path = a.archive or archive_path(classpath or None)
    if path is None:
        print("no java found: no class archive")
        return
    if path.is_file():
        record(path, classpath or None)  # one built before its inputs were recorded
        print(f"JVM class archive: {path}")
        return
    print("building the JVM's class archive (once per JVM and Spark, about a minute)...",
          flush=True)  # fmt: skip
    try:
        ok = build(path, classpath or None)
    except OSError as e:  # an optimization: say why there is none, and let the caller go on
        print(f"no class archive: cannot write {path}: {e.strerror or e}")
        return
    print(
        f"JVM class archive: {path}"
        if ok
        else f"no class archive: {failed_marker(path).read_text()}"
    )


if __name__ == "__main__":
    main()
