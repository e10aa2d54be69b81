"""The driver JVM's class archive (`sluice.pipeline.cds`): built by a real Spark run, mapped by
the next JVM, keyed by what it depends on, off when asked, and removed once nothing can use it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from sluice.pipeline.cds import (
    ENV,
    archive_inputs,
    archive_path,
    build_log,
    digest,
    inputs_file,
    java_options,
    prune,
)
from sluice.pipeline.jvm import cache_dir, compiled

CHILD = """
from sluice.config import config_from_dict
from sluice.pipeline.spark import build_spark
spark = build_spark(config_from_dict({"metrics": [{"name": "n", "key": ["key"], "agg": "count"}]}),
                    "archive-test", sources=False)
print("count", spark.range(1000).selectExpr("id % 7 AS k").groupBy("k").count().count())
bean = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
print("args", list(bean.getInputArguments()))
spark.stop()
"""


@pytest.mark.spark
def test_the_archive_is_built_and_a_new_jvm_maps_it() -> None:
    """`python -m sluice.pipeline.cds_build` (what `make jvm-archive` runs) leaves the archive
    where every local run looks for it; a JVM started by `build_spark` maps it. `-Xshare:on`
    makes a JVM that cannot map its archive fail to start, so the child's answer proves the
    mapping."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    built = subprocess.run([sys.executable, "-m", "sluice.pipeline.cds_build"], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    jar = compiled(cache_dir())  # the class path a local Spark started here would have
    path = archive_path(str(jar) if jar else None)
    assert path is not None
    assert built.returncode == 0 and f"JVM class archive: {path}" in built.stdout, built
    assert path.stat().st_size > 10_000_000
    assert orjson.loads(inputs_file(path).read_bytes()) == archive_inputs(str(jar) if jar else None)
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                           env={**env, "JAVA_TOOL_OPTIONS": "-Xshare:on"}, timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert "count 7" in child.stdout
    assert f"-XX:SharedArchiveFile={path}" in child.stdout


def test_the_options_follow_the_environment_and_what_the_archive_depends_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jar_a, jar_b = tmp_path / "a.jar", tmp_path / "b.jar"
    jar_a.write_bytes(b"a")
    jar_b.write_bytes(b"bb")
    cache = tmp_path / "cache"
    a, b = archive_path(str(jar_a), cache), archive_path(str(jar_b), cache)
    assert a is not None and b is not None and a != b and a.parent == cache
    assert archive_path(str(jar_a), cache) == a  # the same inputs, the same archive
    jar_a.write_bytes(b"changed")
    assert archive_path(str(jar_a), cache) != a  # a rebuilt jar needs another archive
    a = archive_path(str(jar_a), cache)
    assert a is not None

    monkeypatch.setenv(ENV, "off")
    assert java_options(str(jar_a), cache) == ""
    monkeypatch.setenv(ENV, f"dump:{tmp_path / 'x.jsa'}")
    assert java_options(str(jar_a), cache).startswith(f"-XX:ArchiveClassesAtExit={tmp_path}")
    monkeypatch.delenv(ENV)

    cache.mkdir()
    a.with_name(a.name + ".failed").write_text("the workload failed\n")
    assert java_options(str(jar_a), cache) == ""  # a failed build is not tried again...
    assert not a.with_name(a.name + ".log").exists()  # ...so no builder started
    a.write_bytes(b"\0" * 16)
    opts = java_options(str(jar_a), cache)
    assert opts.startswith(f"-XX:SharedArchiveFile={a} ")
    assert "-Xlog:cds=off" in opts  # a JVM that cannot map it starts without it, quietly


def test_a_build_removes_the_archives_that_no_environment_can_use(tmp_path: Path) -> None:
    """An archive whose Spark was upgraded in place, or whose virtualenv was deleted, is never
    mapped again: the next build removes it with its files. One in use stays, and so does one
    whose inputs were never recorded."""
    cache = tmp_path / "cache"
    cache.mkdir()

    def made(jar: Path, **changes: object) -> Path:
        inputs = {**(archive_inputs(str(jar)) or {}), **changes}
        path = cache / digest(inputs)
        path.write_bytes(b"\0" * 16)
        inputs_file(path).write_bytes(orjson.dumps(inputs))
        build_log(path).write_text("built\n")
        return path

    used, upgraded = tmp_path / "used.jar", tmp_path / "upgraded.jar"
    used.write_bytes(b"u")
    upgraded.write_bytes(b"4.2")
    in_use = made(used)
    replaced = made(upgraded)
    upgraded.write_bytes(b"4.3.0")  # the same path, another Spark
    venv = tmp_path / "venv" / "jars"
    venv.mkdir(parents=True)
    (venv / "spark-core.jar").write_bytes(b"core")
    deleted = made(used, jars=str(venv))
    shutil.rmtree(venv.parent)  # the virtualenv deleted
    unrecorded = cache / "cds-0123456789abcdef.jsa"
    unrecorded.write_bytes(b"\0")
    new = made(upgraded)

    assert sorted(prune(cache, keep=new)) == sorted([replaced, deleted])
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([in_use.name, f"{in_use.name}.inputs", f"{in_use.name}.log",
                           new.name, f"{new.name}.inputs", f"{new.name}.log",
                           unrecorded.name])  # fmt: skip
