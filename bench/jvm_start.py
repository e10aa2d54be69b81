"""Start-up with and without the JVM's class archive (sluice.pipeline.cds), side by side.

    .venv/bin/python bench/jvm_start.py            # 3 rounds, ~6 min
    .venv/bin/python bench/jvm_start.py --quick    # 1 round

What a user waits for before Sluice does anything, measured as users run it: per round and way
(`SLUICE_JVM_ARCHIVE=off`, then the archive; the order alternates between rounds),

- **run, cold**: `sluice run` on a fresh state_dir over a pre-filled backlog, from the process's
  start to its first batch recorded (`last_batch` in the stats hash, polled every 50 ms);
- **run, after kill -9**: its whole process group killed (a crash), more events written, and
  `sluice run` started again at once on the same checkpoint: from that start to its next batch
  recorded (the batch in flight is replayed first, as after any crash);
- **training-set**: the command's wall time on a small archive (3,000 events, a 100-row spine,
  3 features), which is mostly start-up.

Redis is an embedded server the benchmark owns (`redis:` in the yaml), so its start is not
counted. The archive is built first if this machine has none (its build time is reported).
Writes bench/results/jvm_start[.quick].json.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import redis
import yaml

from lib.load import bench_config_data, build_pool, prefill
from lib.procs import SluiceProcess, Workspace, wait_until
from lib.results import Run, log, parser
from sluice.config import config_from_dict
from sluice.pipeline.cds import archive_path
from sluice.pipeline.jvm import CLASSPATH_KEY, local_fs_conf
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import STATS_KEY

WAYS = ("off", "archive")
BACKLOG = 20_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def env_of(way: str) -> dict[str, str]:
    return {"SLUICE_JVM_ARCHIVE": "off" if way == "off" else ""}


def last_done(client: redis.Redis) -> int:
    raw = client.hget(STATS_KEY, "last_batch")
    return int(orjson.loads(raw)["done_ms"]) if raw else 0


def run_starts(ws: Workspace, way: str, rnd: int) -> dict[str, float]:
    """Seconds from `sluice run`'s start to its first batch: cold, then after a kill -9."""
    root = ws.state_dir(f"run-{way}-{rnd}")
    with EmbeddedRedis(root / "redis") as server:
        data = bench_config_data("jsonl", root / "state", 100_000) | {"redis": server.url}
        cfg_path = root / "sluice.yaml"
        cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
        cfg = config_from_dict(data)
        client = redis.Redis.from_url(server.url)
        pool = build_pool(cfg, BACKLOG, rnd, now_ms())
        prefill(server.url, pool, BACKLOG)
        out: dict[str, float] = {}
        for phase in ("cold", "after_kill"):
            before = last_done(client)
            t0 = time.monotonic()
            proc = SluiceProcess(["run", "-c", str(cfg_path)], root / "run.log", env_of(way))
            proc.start()
            try:
                wait_until(lambda b=before, p=proc: last_done(client) > b or not p.alive(),
                           "a batch", 300, 0.05)  # fmt: skip
                assert proc.alive(), proc.tail()
                out[phase] = time.monotonic() - t0
                if phase == "cold":
                    proc.kill9()
                    prefill(server.url, pool, BACKLOG // 4)  # arrived while it was down
            finally:
                if phase == "after_kill":
                    proc.stop()
        client.close()
    return out


def training_set_s(ws: Workspace, way: str, rnd: int) -> float:
    """Wall seconds of one small `sluice training-set`."""
    root = ws.state_dir(f"training-{way}-{rnd}")
    rng = np.random.default_rng(rnd)
    at = 1_800_000_000_000
    pd.DataFrame({
        "ts": rng.integers(at - 3_600_000, at, 3000),
        "card": [f"c{i}" for i in rng.integers(0, 20, 3000)],
        "merchant": [f"m{i}" for i in rng.integers(0, 5, 3000)],
        "amount": rng.random(3000),
    }).to_parquet(root / "events.parquet")  # fmt: skip
    pd.DataFrame(
        {
            "card": [f"c{i}" for i in rng.integers(0, 20, 100)],
            "ts": rng.integers(at - 1_800_000, at, 100),
        }
    ).to_parquet(root / "spine.parquet")
    with EmbeddedRedis(root / "redis") as server:
        data = bench_config_data("jsonl", root / "state", 100_000) | {"redis": server.url}
        (root / "sluice.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        metrics = [m["name"] for m in data["metrics"] if m["key"] == ["card"]]
        cmd = [sys.executable, "-m", "sluice.cli", "training-set", "-c", str(root / "sluice.yaml"),
               "--spine", str(root / "spine.parquet"), "--ts", "ts",
               "--features", f"{metrics[0]}:10m,1h", "--features", f"{metrics[1]}:1h",
               "--input", str(root / "events.parquet"),
               "--out", str(root / "table.parquet")]  # fmt: skip
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env_of(way)})  # fmt: skip
        took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-2000:]
    return took


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    a = p.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    run = Run("jvm_start", a)
    classpath = local_fs_conf({}).get(CLASSPATH_KEY)
    archive = archive_path(classpath)
    assert archive is not None, "no java found"
    built_s = None
    if not archive.is_file():
        log("building the class archive first")
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "sluice.pipeline.cds_build"], check=True)
        built_s = time.monotonic() - t0
    ws = Workspace()
    rounds: list[dict[str, Any]] = []
    try:
        for rnd in range(a.rounds):
            order = WAYS if rnd % 2 == 0 else WAYS[::-1]
            got: dict[str, Any] = {}
            for way in order:
                got[way] = run_starts(ws, way, rnd) | {"training_set": training_set_s(ws, way, rnd)}
                log(
                    f"round {rnd} {way}: "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in got[way].items())
                )
            rounds.append(got)
    finally:
        ws.cleanup()
    phases = ("cold", "after_kill", "training_set")
    results: dict[str, Any] = {
        way: {ph: statistics.median(r[way][ph] for r in rounds) for ph in phases} for way in WAYS
    }
    results["ratio"] = {
        ph: statistics.median(r["archive"][ph] / r["off"][ph] for r in rounds) for ph in phases
    }
    results["rounds"] = rounds
    results["archive_mb"] = archive.stat().st_size / 1e6
    results["archive_built_s"] = built_s
    run.write({"rounds": a.rounds, "backlog": BACKLOG, "archive": Path(archive).name}, results)


if __name__ == "__main__":
    main()
