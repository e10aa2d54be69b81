"""Class-data sharing for the driver's JVM: Spark's classes mapped from an archive at start-up.

A JVM that starts Spark loads and verifies some 15,000 classes before the first batch can run:
on 2 busy cores that is most of the 15-25 s a local `sluice run`, `sluice backfill` or
`training-set` spends before its first job. Java 17 can write the classes a run loaded to an
archive when it exits (`-XX:ArchiveClassesAtExit`) and map that archive into later JVMs
(`-XX:SharedArchiveFile`), which then skip the loading and verifying (docs/spark.md, measured
there).

`java_options` gives the options that map the archive, or "" while there is none; then it starts
building one in the background (`python -m sluice.pipeline.cds --background`, its own session,
at a lower priority), so the next start has it. `make setup` builds it in the foreground. The
builder starts Spark as `build_spark` would, with the same options, runs a little of what Sluice
runs (SQL aggregations, Arrow batches to Python, Parquet, a streaming query) and exits; the JVM
writes the archive as it exits, and the builder renames it into place. One builder at a time
(a lock file); a build that failed is not tried again (`<archive>.failed` holds why).

The archive belongs to one JVM, one Spark and one class path: its name is a digest of the java
binary, the Spark jars and the extra class path (the checkpoint file system's jar), so a change
of any of them makes another. A JVM that cannot use the archive (another heap size that turns
compressed pointers off, say) starts as it would without it; the JVM's notices about that are
turned off. About 190 MB per environment (virtualenv) under `$XDG_CACHE_HOME/sluice/jvm` (else
`~/.cache`). `SLUICE_JVM_ARCHIVE=off` turns all of it off.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyspark
from pyspark.find_spark_home import _find_spark_home

from sluice.pipeline.jvm import CLASSPATH_KEY, FS_KEY, cache_dir

log = logging.getLogger(__name__)

ENV = "SLUICE_JVM_ARCHIVE"  # "off": none; "dump:<path>": the builder's own JVM writes <path>
BUILD_TIMEOUT_S = 600.0
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
HADOOP_LOCAL_FS = "org.apache.hadoop.fs.local.LocalFs"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    java = Path(home) / "bin" / "java" if home else None
    found = str(java) if java and java.is_file() else shutil.which("java")
    return Path(found).resolve() if found else None


def _identity(path: Path) -> bytes:
    try:
        st = path.stat()
    except OSError:
        return path.as_posix().encode() + b"\0-"
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()


def archive_path(extra_classpath: str | None, cache: Path | None = None) -> Path | None:
    """Where the archive for this JVM, Spark and class path lives (None without a java)."""
    java = _java()
    if java is None:
        return None
    h = hashlib.sha256(pyspark.__version__.encode())
    h.update(_identity(java))
    for lib in sorted(java.parent.parent.glob("lib/server/libjvm.so")):
        h.update(_identity(lib))
    jars = Path(_find_spark_home()) / "jars"
    for jar in sorted(jars.glob("*.jar")):
        h.update(_identity(jar))
    if extra_classpath:
        for part in extra_classpath.split(os.pathsep):
            h.update(_identity(Path(part)))
    return (cache or cache_dir()) / f"cds-{h.hexdigest()[:16]}.jsa"


def java_options(extra_classpath: str | None, cache: Path | None = None) -> str:
    """The driver JVM's options for the archive: map it if it exists, write it if this is the
    builder, else "" (and a build starts in the background)."""
    mode = os.environ.get(ENV, "")
    if mode == "off":
        return ""
    if mode.startswith("dump:"):
        return f"-XX:ArchiveClassesAtExit={mode.removeprefix('dump:')} {QUIET}"
    path = archive_path(extra_classpath, cache)
    if path is None:
        return ""
    if path.is_file():
        return f"-XX:SharedArchiveFile={path} {QUIET}"
    _start_build(path, extra_classpath)
    return ""


def _start_build(path: Path, extra_classpath: str | None) -> None:
    if _failed(path).exists() or _locked(path):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _log(path).open("wb") as out:
            subprocess.Popen(
                [sys.executable, "-m", "sluice.pipeline.cds", "--background",
                 "--archive", str(path), "--classpath", extra_classpath or ""],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, ENV: ""},
            )  # fmt: skip
        log.info("building the JVM's class archive in the background", extra={"path": str(path)})
    except OSError as e:
        log.debug("cannot start the class archive's build", extra={"error": str(e)})


def _failed(path: Path) -> Path:
    return path.with_name(path.name + ".failed")


def _log(path: Path) -> Path:
    return path.with_name(path.name + ".log")


def _lock_file(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _locked(path: Path) -> bool:
    """Whether a builder holds the archive's lock now."""
    try:
        with _lock_file(path).open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def build(path: Path, extra_classpath: str | None) -> bool:
    """Write the archive at `path` (see the module docstring); True once it is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock_file(path).open("a") as lock:
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
                tmp.rename(path)
                _failed(path).unlink(missing_ok=True)
                _forget_dead_builds(path.parent)
                return True
            _failed(path).write_text(error or "the JVM wrote no archive\n")
            return False
        finally:
            tmp.unlink(missing_ok=True)


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
        print(f"JVM class archive: {path}")
        return
    print("building the JVM's class archive (once per JVM and Spark, about a minute)...",
          flush=True)  # fmt: skip
    ok = build(path, classpath or None)
    print(f"JVM class archive: {path}" if ok else f"no class archive: {_failed(path).read_text()}")


if __name__ == "__main__":
    main()
