"""Ship Sluice's own code to a Spark cluster's executors.

On a cluster the executors run the source's `read`, the decoder and the slice writer, so they
must import `sluice`. They get it as a zip of the installed package (code, Lua scripts, static
files), added with `SparkContext.addPyFile`: Spark copies it to every executor and puts it at
the front of their Python path. Its third-party needs (pyarrow, numpy, redis, orjson,
datasketches) must be installed on the workers; see docs/spark.md.

The zip's name carries a digest of its contents, so executors never run a stale copy and an
unchanged install is zipped once per state directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from pathlib import Path

import sluice

log = logging.getLogger(__name__)


def package_files() -> tuple[Path, list[Path]]:
    """The installed package's root (the directory above `sluice/`) and its files."""
    pkg = Path(sluice.__file__).resolve().parent
    if not pkg.is_dir():
        raise RuntimeError(f"sluice is imported from {pkg}, not a directory: cannot zip it")
    files = sorted(
        p
        for p in pkg.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )
    return pkg.parent, files


def package_zip(dest: Path) -> Path:
    """Write (once) and return `dest/sluice-<digest>.zip` holding the `sluice` package."""
    root, files = package_files()
    digest = hashlib.blake2b(digest_size=8)
    for f in files:
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    out = dest / f"sluice-{digest.hexdigest()}.zip"
    if out.exists():
        return out
    dest.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            z.write(f, str(f.relative_to(root)))
    tmp.replace(out)  # atomic: a concurrent start sees the whole zip or none
    log.info("packaged sluice for executors", extra={"zip": str(out), "files": len(files)})
    return out


def is_local(master: str) -> bool:
    """`local`, `local[4]`, `local[*]`, `local-cluster[...]`: executors share this machine's
    install (local-cluster runs separate executor processes, but of this same Python)."""
    return master.startswith("local")
