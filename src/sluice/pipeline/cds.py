"""Class-data sharing for the driver's JVM: Spark's classes mapped from an archive at start-up.

A JVM that starts Spark loads and verifies some 15,000 classes before the first batch can run:
on 2 busy cores that is most of the 15-25 s a local `sluice run`, `sluice backfill` or
`training-set` spends before its first job. Java 17 can write the classes a run loaded to an
archive when it exits (`-XX:ArchiveClassesAtExit`) and map that archive into later JVMs
(`-XX:SharedArchiveFile`), which then skip the loading and verifying (docs/spark.md, measured
there).

`java_options` gives the options that map the archive, or "" while there is none; then it starts
building one in the background (`python -m sluice.pipeline.cds_build --background`, its own
session, at a lower priority), so the next start has it. `make jvm-archive` builds it in the
foreground. The builder (`cds_build.py`) starts Spark as `build_spark` would, with the same
options, runs a little of what Sluice runs (SQL aggregations, Arrow batches to Python, Parquet,
a streaming query) and exits; the JVM
writes the archive as it exits, and the builder renames it into place. One builder at a time
(a lock file); a build that failed is not tried again (`<archive>.failed` holds why).

The archive belongs to one JVM, one Spark and one class path: its name is a digest of the java
binary, the Spark jars and the extra class path (the checkpoint file system's jar), so a change
of any of them makes another. A JVM that cannot use the archive (another heap size that turns
compressed pointers off, say) starts as it would without it; the JVM's notices about that are
turned off. About 190 MB per environment (virtualenv) under `$XDG_CACHE_HOME/sluice/jvm` (else
`~/.cache`); each build removes the archives whose inputs have changed or are gone since they
were built (`prune`). `SLUICE_JVM_ARCHIVE=off` turns all of it off.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pyspark
from pyspark.find_spark_home import _find_spark_home

from sluice.pipeline.jvm import cache_dir

log = logging.getLogger(__name__)

ENV = "SLUICE_JVM_ARCHIVE"  # "off": none; "dump:<path>": the builder's own JVM writes <path>
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


def archive_inputs(extra_classpath: str | None) -> dict[str, Any] | None:
    """What an archive is made for: this Spark, java binary and extra class path (None without
    a java). Written beside the archive (`inputs_file`), so that a later build can tell which
    archives no environment can use any more (`prune`)."""
    java = _java()
    if java is None:
        return None
    return {"spark": pyspark.__version__, "java": str(java),
            "jars": str(Path(_find_spark_home()) / "jars"),
            "classpath": extra_classpath.split(os.pathsep) if extra_classpath else []}  # fmt: skip


def digest(inputs: dict[str, Any]) -> str:
    """The archive's name for `inputs`: it changes when any file they name changes."""
    java = Path(inputs["java"])
    h = hashlib.sha256(inputs["spark"].encode())
    h.update(_identity(java))
    for lib in sorted(java.parent.parent.glob("lib/server/libjvm.so")):
        h.update(_identity(lib))
    for jar in sorted(Path(inputs["jars"]).glob("*.jar")):
        h.update(_identity(jar))
    for part in inputs["classpath"]:
        h.update(_identity(Path(part)))
    return f"cds-{h.hexdigest()[:16]}.jsa"


def archive_path(extra_classpath: str | None, cache: Path | None = None) -> Path | None:
    """Where the archive for this JVM, Spark and class path lives (None without a java)."""
    inputs = archive_inputs(extra_classpath)
    return None if inputs is None else (cache or cache_dir()) / digest(inputs)


def prune(cache: Path, keep: Path) -> list[Path]:
    """Remove the archives (and their lock, log and failure files) whose inputs have changed or
    are gone, as after a Spark upgrade or with a deleted virtualenv: no JVM maps them again.
    An archive whose inputs were not recorded, and `keep`, stay. Returns what was removed."""
    gone = []
    for record in cache.glob("cds-*.jsa.inputs"):
        archive = record.with_suffix("")
        if archive == keep:
            continue
        try:
            stale = digest(orjson.loads(record.read_bytes())) != archive.name
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if stale and not _locked(archive):
            for f in (archive, failed_marker(archive), build_log(archive), lock_file(archive),
                      record):  # fmt: skip
                f.unlink(missing_ok=True)
            gone.append(archive)
    return gone


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
    if failed_marker(path).exists() or _locked(path):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with build_log(path).open("wb") as out:
            subprocess.Popen(
                [sys.executable, "-m", "sluice.pipeline.cds_build", "--background",
                 "--archive", str(path), "--classpath", extra_classpath or ""],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, ENV: ""},
            )  # fmt: skip
        log.info("building the JVM's class archive in the background", extra={"path": str(path)})
    except OSError as e:
        log.debug("cannot start the class archive's build", extra={"error": str(e)})


def inputs_file(path: Path) -> Path:
    return path.with_name(path.name + ".inputs")


def failed_marker(path: Path) -> Path:
    return path.with_name(path.name + ".failed")


def build_log(path: Path) -> Path:
    return path.with_name(path.name + ".log")


def lock_file(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _locked(path: Path) -> bool:
    """Whether a builder holds the archive's lock now."""
    try:
        with lock_file(path).open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
