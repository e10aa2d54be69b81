"""The one compiled part of Sluice, optional: without a C compiler it is skipped and the same
merge runs in Python (src/sluice/slices/state.py). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("sluice.slices._sums", ["src/sluice/slices/_sums.c"], optional=True),
    ]
)
