"""Checkpoint writes without a child process per file, for a local Spark.

Spark writes two log files per micro-batch into the checkpoint (the offsets before the batch,
the commit after it). On the local file system, Hadoop without its native library sets each new
file's permissions by starting a `chmod` process, once for the file and once for its checksum
file: measured at 30-70 ms per batch on 2 busy cores, on the critical path of every batch and
of a takeover. `LocalFs.java` (beside this module) is Hadoop's local file system for Spark's
checkpoint manager with that one call done through java.nio instead.

`local_fs_conf` compiles it once per source digest and Spark version into a jar in the user's
cache (`$XDG_CACHE_HOME/sluice/jvm/<digest>/localfs.jar`, else `~/.cache/...`; javac from
JAVA_HOME or PATH, about 2 s) and returns the Spark settings that install it. A jar, not a
directory of classes: the JVM's class-data sharing (`sluice.pipeline.cds`) refuses a class path
with a non-empty directory on it. Only a process that starts its JVM
can add a class to it, so it returns nothing when a Spark context already runs. Without a JDK,
or if compiling fails, it returns nothing too and Spark keeps Hadoop's own class: slower
batches, same results. Settings the user gave win.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

import pyspark
from pyspark import SparkContext

log = logging.getLogger(__name__)

CLASS = "sluice.hadoop.LocalFs"
FS_KEY = "spark.hadoop.fs.AbstractFileSystem.file.impl"
CLASSPATH_KEY = "spark.driver.extraClassPath"
COMPILE_TIMEOUT_S = 120.0
JAR = "localfs.jar"


def javac() -> str | None:
    """The Java compiler of the JDK Spark runs on: JAVA_HOME's, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").is_file():
        return str(Path(home) / "bin" / "javac")
    return shutil.which("javac")


def hadoop_jars() -> list[Path]:
    """The Hadoop API jar(s) PySpark ships, to compile against."""
    jars = Path(pyspark.__file__).resolve().parent / "jars"
    return sorted(jars.glob("hadoop-client-api-*.jar"))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "jvm"


def compiled(cache: Path) -> Path | None:
    """The jar holding the compiled classes (compiled now if needed), or None when it cannot be
    built here. Concurrent processes each compile into a temporary directory and the first
    rename wins."""
    source = (resources.files("sluice.pipeline") / "LocalFs.java").read_bytes()
    jars = hadoop_jars()
    digest = hashlib.sha256(source + pyspark.__version__.encode() + b"jar").hexdigest()[:16]
    out = cache / digest
    if (out / JAR).is_file():
        return out / JAR
    compiler = javac()
    if compiler is None or not jars:
        log.info(
            "no JDK compiler found: checkpoint writes start a chmod process per file",
            extra={"hint": "install a JDK (javac) or set JAVA_HOME for faster micro-batches"},
        )
        return None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".compile-", dir=out.parent))
    except OSError as e:
        log.warning("cannot compile the checkpoint file system; using Hadoop's",
                    extra={"error": str(e)})  # fmt: skip
        return None
    try:
        src = tmp / "LocalFs.java"
        src.write_bytes(source)
        cmd = [compiler, "-nowarn", "-d", str(tmp / "classes"),
               "-cp", os.pathsep.join(map(str, jars)), str(src)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            log.warning("could not compile the checkpoint file system; using Hadoop's",
                        extra={"error": done.stderr.strip()[-500:]})  # fmt: skip
            return None
        (tmp / "out").mkdir()
        with zipfile.ZipFile(tmp / "out" / JAR, "w") as jar:
            for cls in sorted((tmp / "classes").rglob("*.class")):
                jar.write(cls, cls.relative_to(tmp / "classes").as_posix())
        try:
            (tmp / "out").rename(out)
        except OSError:  # another process renamed its copy first
            if not (out / JAR).is_file():
                raise
        return out / JAR
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not compile the checkpoint file system; using Hadoop's",
                    extra={"error": str(e)})  # fmt: skip
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def local_fs_conf(user_conf: dict[str, str], cache: Path | None = None) -> dict[str, str]:
    """Spark settings that install LocalFs for the driver, or {} (see the module docstring)."""
    if FS_KEY in user_conf or CLASSPATH_KEY in user_conf:
        return {}
    if SparkContext._active_spark_context is not None or SparkContext._gateway is not None:
        return {}  # the JVM runs already: its class path is set
    jar = compiled(cache or cache_dir())
    if jar is None:
        return {}
    return {FS_KEY: CLASS, CLASSPATH_KEY: str(jar)}
