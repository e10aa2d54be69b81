"""The checkpoint file system (`sluice.pipeline.jvm`, `LocalFs.java`) in a real local Spark: the
shared session installs it, and Spark's own checkpoint file manager writes, reads, renames and
lists through it as through Hadoop's LocalFs, with the same permissions and link status."""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest

from sluice.pipeline.jvm import CLASS, FS_KEY, compiled, javac, local_fs_conf

pytestmark = pytest.mark.skipif(javac() is None, reason="no JDK compiler on this machine")

MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager"
)


def _manager(spark: Any, root: Path, impl: str) -> Any:
    jvm = spark._jvm
    conf = jvm.org.apache.hadoop.conf.Configuration(spark.sparkContext._jsc.hadoopConfiguration())
    conf.set("fs.AbstractFileSystem.file.impl", impl)
    cls = jvm
    for part in MANAGER.split("."):
        cls = getattr(cls, part)
    return cls(jvm.org.apache.hadoop.fs.Path(str(root)), conf)


def _write(spark: Any, mgr: Any, path: Path, data: bytes) -> None:
    out = mgr.createAtomic(spark._jvm.org.apache.hadoop.fs.Path(str(path)), False)
    out.write(data)
    out.close()


def test_the_shared_session_installs_it(spark: Any) -> None:
    hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
    assert hadoop_conf.get(FS_KEY.removeprefix("spark.hadoop.")) == CLASS
    fc = spark._jvm.org.apache.hadoop.fs.FileContext.getFileContext(
        spark.sparkContext._jsc.hadoopConfiguration()
    )
    assert fc.getDefaultFileSystem().getClass().getName() == CLASS


def test_it_writes_as_hadoops_local_fs(spark: Any, tmp_path: Path) -> None:
    """The same files (checksums too), bytes and modes as org.apache.hadoop.fs.local.LocalFs."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for root, impl in ((ours, CLASS), (theirs, "org.apache.hadoop.fs.local.LocalFs")):
        root.mkdir()
        mgr = _manager(spark, root, impl)
        mgr.mkdirs(spark._jvm.org.apache.hadoop.fs.Path(str(root / "offsets")))
        for i in range(3):
            _write(spark, mgr, root / "offsets" / str(i), f"batch {i}".encode())
    assert sorted(p.name for p in (ours / "offsets").iterdir()) == sorted(
        p.name for p in (theirs / "offsets").iterdir()
    )
    assert {p.name for p in (ours / "offsets").iterdir()} >= {"0", "1", "2", ".0.crc"}
    for i in range(3):
        a, b = ours / "offsets" / str(i), theirs / "offsets" / str(i)
        assert a.read_bytes() == b.read_bytes() == f"batch {i}".encode()
        assert stat.S_IMODE(a.stat().st_mode) == stat.S_IMODE(b.stat().st_mode)
        assert stat.S_IMODE((ours / "offsets" / f".{i}.crc").stat().st_mode) == stat.S_IMODE(
            (theirs / "offsets" / f".{i}.crc").stat().st_mode
        )


def test_status_and_links(spark: Any, tmp_path: Path) -> None:
    jvm = spark._jvm
    Path_ = jvm.org.apache.hadoop.fs.Path
    mgr = _manager(spark, tmp_path, CLASS)
    _write(spark, mgr, tmp_path / "f", b"12345")
    os.chmod(tmp_path / "f", 0o640)
    os.symlink(tmp_path / "f", tmp_path / "link")

    def context(impl: str) -> Any:
        conf = jvm.org.apache.hadoop.conf.Configuration(
            spark.sparkContext._jsc.hadoopConfiguration()
        )
        conf.set("fs.AbstractFileSystem.file.impl", impl)
        return jvm.org.apache.hadoop.fs.FileContext.getLocalFSFileContext(conf)

    fc, hadoops = context(CLASS), context("org.apache.hadoop.fs.local.LocalFs")
    st = fc.getFileStatus(Path_(str(tmp_path / "f")))
    assert st.getLen() == 5 and not st.isDirectory()
    assert st.getPermission().toShort() == 0o640
    assert st.getOwner() and st.getGroup()
    theirs = hadoops.getFileStatus(Path_(str(tmp_path / "f")))
    assert (st.getOwner(), st.getGroup()) == (theirs.getOwner(), theirs.getGroup())
    assert st.getPath().toString() == theirs.getPath().toString()
    link = fc.getFileLinkStatus(Path_(str(tmp_path / "link")))
    assert link.isSymlink() and link.getSymlink().toString().endswith(str(tmp_path / "f"))
    their_link = hadoops.getFileLinkStatus(Path_(str(tmp_path / "link")))
    assert link.getSymlink().toString() == their_link.getSymlink().toString()
    assert fc.getFileStatus(Path_(str(tmp_path / "link"))).getLen() == 5  # followed
    assert not mgr.exists(Path_(str(tmp_path / "missing")))
    assert mgr.exists(Path_(str(tmp_path / "f")))
    names = sorted(s.getPath().getName() for s in mgr.list(Path_(str(tmp_path))))
    assert names == ["f", "link"]  # checksum files hidden, as by Hadoop's LocalFs


def test_compiled_once_per_source(tmp_path: Path) -> None:
    first = compiled(tmp_path)
    assert first is not None and first.name == "localfs.jar"
    with zipfile.ZipFile(first) as jar:
        assert "sluice/hadoop/LocalFs.class" in jar.namelist()
    mtime = first.stat().st_mtime_ns
    assert compiled(tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.parent.name]  # no compile dir left


def test_left_alone_when_the_user_sets_it_or_the_jvm_runs(spark: Any, tmp_path: Path) -> None:
    assert local_fs_conf({FS_KEY: "x.Y"}, tmp_path) == {}
    assert local_fs_conf({"spark.driver.extraClassPath": "/opt/x"}, tmp_path) == {}
    assert local_fs_conf({}, tmp_path) == {}  # the shared session's JVM runs already
    assert not any(tmp_path.iterdir())
