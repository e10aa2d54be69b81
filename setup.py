"""Sluice's compiled parts, optional: without a C compiler they are skipped and the same work
runs in Python (the count and sum merge in src/sluice/slices/state.py, a backfill's RESTORE
payloads in src/sluice/pipeline/slice_restore.py). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("sluice.slices._sums", ["src/sluice/slices/_sums.c"], optional=True),
        Extension("sluice.redis._dump", ["src/sluice/redis/_dump.c"], optional=True),
    ]
)
