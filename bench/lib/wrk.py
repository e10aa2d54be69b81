"""wrk, the C load generator, with requests from a file (GET paths or POST bodies).

Its Lua script (`wrk.lua`) prints one JSON line (`SLUICE_WRK {...}`) with the counts, errors and
latency percentiles. wrk keeps its connections alive (closed loop); with `think_ms` each
connection waits an exponential think time before each request.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LUA = Path(__file__).with_name("wrk.lua")
MARK = "SLUICE_WRK "


def require_wrk() -> None:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is required: apt-get install -y wrk (Debian/Ubuntu)")


@dataclass
class WrkResult:
    """One wrk run. Latencies in ms; `errors` by kind (connect, read, write, status, timeout);
    `extra` holds what the caller measured around it (CPU, Redis time, drain)."""

    requests: int
    duration_s: float
    errors: dict[str, int]
    max_ms: float
    pct_ms: dict[float, float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class WrkJob:
    """One wrk invocation: `mode` "get" or "batch" (POST /v1/query), requests from a file."""

    base_url: str
    requests_file: Path
    mode: str
    connections: int
    threads: int
    duration_s: float
    think_ms: float = 0.0  # mean think time per connection before each request; 0 = none
    timeout_s: float = 10.0


def run_wrk(job: WrkJob) -> WrkResult:
    """Run wrk to completion (bounded by its -d plus a margin). Raises RuntimeError on failure."""
    cmd = ["wrk", f"-t{min(job.threads, job.connections)}", f"-c{job.connections}",
           f"-d{job.duration_s:g}s", f"--timeout={job.timeout_s:g}s", "-s", str(LUA), job.base_url,
           "--", job.mode, str(job.requests_file), f"{job.think_ms:.3f}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         timeout=job.duration_s + job.timeout_s + 60)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-1500:]}")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result line:\n{out.stdout[-1500:]}")
    d = json.loads(line[len(MARK) :])
    return WrkResult(
        requests=int(d["requests"]), duration_s=d["duration_us"] / 1e6,
        errors={k: int(d[k]) for k in ("connect", "read", "write", "status", "timeout")},
        max_ms=d["max_us"] / 1000, pct_ms={float(q): v / 1000 for q, v in d["pct_us"].items()},
    )  # fmt: skip
