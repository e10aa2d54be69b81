"""The driver JVM's class archive (`sluice.pipeline.cds`): built by a real Spark run, mapped by
the next JVM, keyed by what it depends on, and off when asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.pipeline.cds import ENV, archive_path, java_options
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
