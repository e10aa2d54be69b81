"""Where a process' Python CPU goes: py-spy's sampled stacks, summarised by package and function.

py-spy samples non-blocking with `--gil` (only the thread holding the GIL), so the shares say
where the Python CPU goes, not where the process waits.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lib.results import log

RATE_HZ = 200
PACKAGES = ("sluice", "redis", "starlette", "fastapi", "anyio", "uvicorn", "httptools",
            "uvloop", "pydantic", "orjson", "asyncio", "concurrent", "threading", "socket",
            "selectors")  # fmt: skip


def find(arg: str) -> str | None:
    """The py-spy binary: `arg` itself, None for 'off', or for 'auto' the venv's or PATH's."""
    if arg != "auto":
        return None if arg == "off" else arg
    beside = Path(sys.executable).parent / "py-spy"  # the dev extra installs it in the venv
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_during(py_spy: str, pid: int, seconds: float, keep: Path | None,
                   work: Callable[[], object]) -> str | None:  # fmt: skip
    """Sample `pid` for `seconds` while `work()` runs (started 1 s later, so py-spy has
    attached); py-spy's collapsed stacks, or None if it failed. `keep`: copy them there."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stacks.txt"
        spy = subprocess.Popen(
            [py_spy, "record", "-p", str(pid), "-d", f"{seconds:.0f}", "-r", str(RATE_HZ), "-f",
             "raw", "-o", str(out), "--nonblocking", "--gil"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        try:
            time.sleep(1.0)
            work()
            spy.wait(timeout=seconds + 30)
        finally:
            if spy.poll() is None:
                spy.kill()
                spy.wait(timeout=5)
        if spy.returncode != 0 or not out.exists():
            err = spy.stderr.read()[-300:] if spy.stderr else b""
            log(f"py-spy failed ({spy.returncode}): {err!r}")
            return None
        if keep is not None:
            shutil.copyfile(out, keep)
        return out.read_text()


def _short_frame(frame: str) -> str:
    """`func (/long/path/site-packages/pkg/mod.py:12)` -> `func (pkg/mod.py:12)`."""
    name, _, where = frame.partition(" (")
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    return f"{name} ({where.rstrip(')')})"


def summarize(raw: str, inclusive: Sequence[tuple[str, str, bool]]) -> dict[str, Any]:
    """Shares of py-spy's collapsed stacks: self time by package (top 10) and by function (top
    12), and for each (label, marker, negate) of `inclusive` the share of samples whose stack
    contains the marker (or, negated, does not)."""
    by_pkg: collections.Counter[str] = collections.Counter()
    by_fn: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            leaf, path = stack.split(";")[-1], "/" + stack.split(";")[-1].rsplit("(", 1)[-1]
            pkg = next((p for p in PACKAGES if f"/{p}/" in path or f"/{p}.py" in path), "other")
            by_pkg[pkg] += int(count)
            by_fn[leaf] += int(count)
            for label, marker, negate in inclusive:
                incl[label] += int(count) if (marker in stack) != negate else 0
    total = max(1, sum(by_pkg.values()))
    return {"samples": sum(by_pkg.values()),
            "packages": [[k, v / total] for k, v in by_pkg.most_common(10)],
            "functions": [[_short_frame(k), v / total] for k, v in by_fn.most_common(12)],
            "inclusive": [[label, incl[label] / total] for label, _, _ in inclusive]}  # fmt: skip
