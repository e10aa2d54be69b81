"""One JSON file per benchmark run: what was measured, and when, where and how it was run.

A result file holds `benchmark`, `run` (command, date, machine, load averages, duration, quick,
code, note), `params`, `results` (every number the docs quote, already summarised) and, when a
plot needs them, `series`. `bench/render.py` turns the files into docs/benchmarks.md; it never
measures. Quick runs go to `<name>.quick.json`, so they never replace a full run's numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the wall clock."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: its own flags go on top of `--quick`, `--out`, `--note`."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes, short runs")
    p.add_argument("--out", type=Path, help="result file (default bench/results/<name>.json)")
    p.add_argument("--note", default="", help="a remark on this run, shown in the docs")
    return p


def machine() -> str:
    """Cores, CPU model and OS, e.g. `2 cores (AMD EPYC 7B13), Linux 6.1.0`."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = f" ({line.split(':', 1)[1].strip()})"
                break
    return f"{os.cpu_count()} cores{model}, {platform.system()} {platform.release()}"


def code_version() -> str:
    """The commit measured, and whether src/ differed from it (others edit it meanwhile)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "src")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"commit {head}" + (" with uncommitted changes under src/" if dirty else "")


def _display(p: str) -> str:
    """`p` relative to the repository root when inside it (symlinks not followed)."""
    try:
        return str(Path(os.path.abspath(p)).relative_to(ROOT))
    except ValueError:
        return p


class Run:
    """A benchmark run from its start (`args` from `parser`): call `write` once measured."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.quick = name, bool(args.quick)
        self.path = args.out or RESULTS_DIR / (
            f"{name}.quick.json" if self.quick else f"{name}.json"
        )
        self.t0 = time.monotonic()
        self.info: dict[str, Any] = {
            "command": shlex.join([_display(sys.executable), _display(sys.argv[0]), *sys.argv[1:]]),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "load_start": os.getloadavg()[0], "quick": self.quick, "code": code_version(),
            "note": args.note,
        }  # fmt: skip

    def write(self, params: dict[str, Any], results: dict[str, Any],
              series: dict[str, Any] | None = None) -> None:  # fmt: skip
        """Write the result file (creating its directory)."""
        self.info.update(load_end=os.getloadavg()[0], took_s=round(time.monotonic() - self.t0, 1))
        doc = {"benchmark": self.name, "run": self.info, "params": params, "results": results}
        text = json.dumps(doc, indent=1, default=_plain)
        if series:  # on one line: plots need many points, nobody reads them
            text = f'{text[:-2]},\n "series": {json.dumps(series, default=_plain)}\n}}'
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text + "\n")
        log(f"wrote {_display(str(self.path))}; `python bench/render.py` updates the docs")


def _plain(x: Any) -> Any:
    """JSON for numpy scalars (their Python value), and anything else as text."""
    return x.item() if hasattr(x, "item") else str(x)
