"""`sluice backfill` as users run it: a real process on a Parquet archive, real Spark and Redis;
its answers checked against DuckDB; clear one-line errors; and a run killed halfway (kill -9 of
the whole process group, Spark's JVM included) then run again, which ends exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import redis
import yaml

from sluice.config import Config, config_from_dict
from sluice.offline.backfill import seam_of
from sluice.slices.window import slice_start
from tests.conftest import config_data, wait_until
from tests.e2e.test_oracle import make_events
from tests.integration.test_backfill import check_below_seams

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SLUICE = str(Path(sys.executable).with_name("sluice"))
TEN_MIN = 600_000
PARTITIONS = 16  # spark.shuffle_partitions: the backfill's write tasks
# A few of the test config's metrics (tests/conftest.py): a filter, several resolutions, `last`.
METRICS = ("txn_count", "amount_sum", "card_last", "txn_res")


def write_config(redis_url: str, tmp_path: Path, **spark: Any) -> tuple[Path, Config]:
    data = config_data(redis_url, tmp_path / "state", derived=[], spark=spark)
    data["metrics"] = [m for m in data["metrics"] if m["name"] in METRICS]
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, config_from_dict(data)


def sluice(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SLUICE, *args], capture_output=True, text=True, timeout=timeout_s)


def one_error_line(res: subprocess.CompletedProcess[str], spark: bool = False) -> str:
    """The one line a failed command ends with (exit 1). Before Spark starts, it is all of
    stderr; after, only the JVM's own start-up notes may come before it."""
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert res.stdout == "" and (len(lines) == 1 or spark), res.stderr
    assert "Traceback" not in res.stderr and "Exception" not in res.stderr, res.stderr
    assert sum(ln.startswith("Error: ") for ln in lines) == 1, res.stderr
    return lines[-1]


def test_backfill_command_folds_an_archive_and_reports(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    now = time.time_ns() // 1_000_000
    until = slice_start(now, TEN_MIN)
    events = make_events(now, 10_000)
    bad = events.head(3).assign(card=None)  # a non-nullable field missing: not folded
    half = len(events) // 2
    events.iloc[:half].to_parquet(tmp_path / "a.parquet")
    pd.concat([events.iloc[half:], bad]).to_parquet(tmp_path / "b.parquet")
    path, cfg = write_config(redis_url, tmp_path)
    until_iso = pd.Timestamp(until, unit="ms").strftime("%Y-%m-%dT%H:%M:%S")  # naive: UTC
    res = sluice("backfill", "-c", str(path), "--input", str(tmp_path / "a.parquet"),
                 "--input", str(tmp_path / "b.parquet"), "--metrics", ",".join(METRICS),
                 "--until", until_iso, "--progress-every", "0.5")  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)  # one JSON line, nothing else
    assert res.stdout.count("\n") == 1
    assert report["seams"] == {m.name: seam_of(until, m) for m in cfg.metrics}
    assert report["events"] == (events.ts < until).sum()  # events after `--until` are not read
    assert report["dead"] == {"missing_field": 3}
    assert report["partitions"] >= 2 and report["partitions_skipped"] == 0
    err = res.stderr.splitlines()
    progress = [ln for ln in err if ln.startswith("backfill: ")]
    assert progress and any(" tasks, " in ln for ln in progress), res.stderr
    assert f"backfill {report['run']}: {report['events']:,} events folded into" in res.stderr
    seam_iso = pd.Timestamp(until, unit="ms").strftime("%Y-%m-%dT%H:%M:%SZ")
    assert f"  seam {seam_iso} ({until}): " in res.stderr
    assert "  bad rows: 3 (not folded)" in res.stderr
    assert '  missing_field          3  e.g. {"' in res.stderr
    assert check_below_seams(cfg, r, events, until, n=800) >= 50


def test_backfill_command_errors_are_one_line(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    path, _ = write_config(redis_url, tmp_path)
    line = one_error_line(sluice("backfill", "-c", str(path), "--input", str(tmp_path / "no")))
    assert line == f"Error: input '{tmp_path / 'no'}' does not exist (no such file or directory)"
    pd.DataFrame({"ts": [1], "merchant": ["m"]}).to_parquet(tmp_path / "narrow.parquet")
    args = ["backfill", "-c", str(path), "--input", str(tmp_path / "narrow.parquet")]
    res = sluice(*args, "--metrics", "txn_count,nope")  # a usage error, naming the option
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: Invalid value for '--metrics': metric 'nope' is unknown;"), line
    line = one_error_line(sluice(*args), spark=True)
    assert line.startswith("Error: input has no column '"), line
    assert line.endswith("; its columns are ts, merchant"), line


def done_partitions(r: redis.Redis) -> int:
    return sum(int(r.scard(k)) for k in r.scan_iter(match="sluice:{backfill}:*:done"))


def settled(count: Any, quiet_s: float = 1.0, timeout_s: float = 15.0) -> int:
    """`count()` once it has not changed for `quiet_s` (at most `timeout_s`)."""
    value, since = count(), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != value:
            value, since = now, time.monotonic()
    return int(value)


def stopped(args: list[str], log: Path, sig: int, ready: Any, what: str) -> tuple[int, str]:
    """Run `args` (stderr to `log`) until `ready()`, then send `sig` to its whole process group
    (the driver, Spark's JVM and its Python workers). Returns (exit code, stderr). Fails if it
    ended before."""
    with log.open("w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: ready() or proc.poll() is not None, 240, what, every_s=0.02)
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: make the"
                        f" archive bigger\n{log.read_text()}")  # fmt: skip
        os.killpg(proc.pid, sig)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    return proc.returncode, log.read_text()


def test_a_backfill_stopped_halfway_and_run_again_is_exact(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    now = time.time_ns() // 1_000_000
    until = slice_start(now, TEN_MIN)
    events = make_events(now, 60_000)
    archive = tmp_path / "archive.parquet"
    events.to_parquet(archive)
    path, cfg = write_config(redis_url, tmp_path, shuffle_partitions=PARTITIONS)
    args = [SLUICE, "backfill", "-c", str(path), "--input", str(archive), "--until", str(until)]
    # kill -9 of the whole group once a partition is written: what was half written stays.
    before = done_partitions(r)
    code, err = stopped([*args, "--json"], tmp_path / "kill.log", signal.SIGKILL,
                        lambda: done_partitions(r) > before, "a partition was written")  # fmt: skip
    assert code == -signal.SIGKILL and "backfill: " not in err, err  # --json: no progress
    # What a killed worker had already sent still reaches Redis: count once it has settled.
    written = settled(lambda: done_partitions(r))
    assert written < PARTITIONS, f"all {PARTITIONS} partitions written: make the archive bigger"
    # Run again: the partitions written are skipped, the rest written, the answers exact.
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["partitions"] == PARTITIONS
    assert report["partitions_skipped"] == written
    assert f"{written} skipped (written by an earlier run of it)" in again.stderr
    assert 0 < report["events"] < len(events)  # only the partitions not written before
    assert check_below_seams(cfg, r, events, until, n=800) >= 50


@pytest.mark.parametrize("moment", ["jvm", "context"])
def test_ctrl_c_while_spark_starts_is_one_line_saying_how_to_finish(
    r: redis.Redis, redis_url: str, tmp_path: Path, moment: str
) -> None:
    """SIGINT to the whole group while Spark starts: as soon as its JVM runs (PySpark waits for
    its gateway), or once Spark's context listens (PySpark's own handler would be in place
    then). The run says it stopped and how to run it again, with no py4j traceback and no
    `Aborted!`, and its JVM is gone too (it ignores SIGINT; cut short, PySpark's start left
    it running for good)."""
    import psutil

    path, _ = write_config(redis_url, tmp_path)
    # Enough events that the run is still going a second after Spark's context starts.
    make_events(time.time_ns() // 1_000_000, 50_000).to_parquet(tmp_path / "a.parquet")
    args = [SLUICE, "backfill", "-c", str(path), "--input", str(tmp_path / "a.parquet")]
    log = tmp_path / "int.log"
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=out,
                                start_new_session=True)  # fmt: skip
    jvms: list[psutil.Process] = []
    try:

        def started() -> bool:  # its JVM runs; for "context", it listens on 3 ports or more
            try:
                kids = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return True  # it ended: said below
            ports = 0
            for kid in kids:
                try:  # a child may end while it is looked at
                    if "java" in kid.name():
                        jvms[:] = [kid]
                        ports += sum(c.status == "LISTEN" for c in kid.net_connections("tcp"))
                except psutil.NoSuchProcess:
                    continue
            return bool(jvms) and (moment == "jvm" or ports >= 3)

        wait_until(started, 120, f"Spark's {moment} started", every_s=0.01)
        if moment == "context":  # its session and data sources take seconds more
            time.sleep(1.0)
        assert proc.poll() is None, log.read_text()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    err = log.read_text()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "backfill: stopped by SIGINT after" in err and "Run it again with --until" in err, err
    assert "Traceback" not in err and "Aborted" not in err and "level=ERROR" not in err, err
    _, alive = psutil.wait_procs(jvms, timeout=20)
    for jvm in alive:
        jvm.kill()
    assert not alive, f"the JVM outlived the run: {[p.pid for p in alive]}"


def test_a_store_that_refuses_the_writes_is_one_line_naming_its_error(tmp_path: Path) -> None:
    """A Redis out of memory (`maxmemory`, no eviction) fails a write task: the command ends
    with the task's error in one line and what to do, not Spark's and Python's traces."""
    from sluice.redis.embedded import EmbeddedRedis

    limits = ["maxmemory 3mb", "maxmemory-policy noeviction"]
    full = EmbeddedRedis(tmp_path / "full", extra_config=limits)
    full.start()
    try:
        path, _ = write_config(full.url, tmp_path)
        now = time.time_ns() // 1_000_000
        n = 60_000
        pd.DataFrame({"ts": [now - 1_000 - 40 * i for i in range(n)],
                      "card": [f"card-{i % 20_000}" for i in range(n)], "merchant": "m",
                      "amount": 1.0, "qty": 1}).to_parquet(tmp_path / "big.parquet")  # fmt: skip
        res = sluice("backfill", "-c", str(path), "--input", str(tmp_path / "big.parquet"))
        line = one_error_line(res, spark=True)
        assert line.startswith("Error: a Spark task failed: ResponseError: "), line
        assert "OOM command not allowed" in line, line
        assert line.endswith("skips the partitions it wrote and writes the rest (exact)"), line
    finally:
        full.stop()
