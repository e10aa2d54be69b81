"""`sluice run` on a real Spark standalone cluster (a master and 2 workers, separate JVMs on
loopback): Sluice ships its own code to the executors, both workers run tasks, and the oracle
check of test_oracle holds for every metric."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from sluice.config import config_from_dict
from sluice.redis.keys import STATS_KEY
from sluice.testing.standalone import StandaloneCluster
from tests.conftest import config_data
from tests.e2e.test_oracle import check_answers, make_events, produce

pytestmark = [pytest.mark.spark, pytest.mark.slow]
N_EVENTS = 60_000


def test_the_pipeline_on_a_standalone_cluster_matches_the_reference(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    now = time.time_ns() // 1_000_000
    events = make_events(now, N_EVENTS)
    with StandaloneCluster(tmp_path / "spark", workers=2, cores=1) as cluster:
        data = config_data(
            redis_url,
            tmp_path / "state",
            source={"max_events_per_batch": 30_000},
            spark={
                "master": cluster.master,
                "trigger": "500ms",
                "conf": {
                    "spark.executor.memory": "512m",
                    "spark.cores.max": "2",
                    "spark.driver.host": "127.0.0.1",
                    "spark.driver.bindAddress": "127.0.0.1",
                },
            },
        )
        cfg = config_from_dict(data)
        path = tmp_path / "sluice.yaml"
        path.write_text(yaml.safe_dump(data))
        produce(cfg, r, events, now)
        log = (tmp_path / "run.log").open("wb")
        run = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "run", "-c", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 400
            while int(r.hget(STATS_KEY, "events_in") or 0) < N_EVENTS + 40:
                assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the cluster did not drain its input"
                time.sleep(0.5)
            (app,) = cluster.state()["activeapps"]
            assert app["name"] == "sluice" and app["cores"] == 2, app
        finally:
            run.send_signal(signal.SIGTERM)
            assert run.wait(90) == 0, (tmp_path / "run.log").read_text()[-3000:]
        # Each worker ran an executor, and each executor got Sluice as the shipped zip.
        for i in range(2):
            shipped = list(cluster.worker_dir(i).glob("app-*/*/sluice-*.zip"))
            assert shipped, f"worker {i} has no shipped sluice zip"
    check_answers(cfg, r, events, now)
    stats = {k.decode(): v.decode() for k, v in r.hgetall(STATS_KEY).items()}
    assert int(stats["audit_ok"]) == int(stats["batches"]) and "audit_failed" not in stats


def test_under_spark_submit_the_submitted_master_wins(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """`spark-submit … "$(sluice submit-path)" run`: the config names a master nobody listens
    on, so the pipeline can only run on the one spark-submit was given."""
    from sluice.testing.standalone import SPARK_HOME, spark_env

    now = time.time_ns() // 1_000_000
    events = make_events(now, 5_000)
    data = config_data(
        redis_url, tmp_path / "state", spark={"master": "spark://127.0.0.1:9", "trigger": "200ms"}
    )
    cfg = config_from_dict(data)
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    produce(cfg, r, events, now)
    main_file = (
        subprocess.run(
            [sys.executable, "-m", "sluice.cli", "submit-path"], capture_output=True, check=True
        )
        .stdout.decode()
        .strip()
    )
    assert main_file.endswith("spark_main.py")
    env = {**spark_env(), "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    log = (tmp_path / "submit.log").open("wb")
    submit = subprocess.Popen(
        [str(SPARK_HOME / "bin" / "spark-submit"), "--master", "local[2]",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
         main_file, "run", "-c", str(path)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while int(r.hget(STATS_KEY, "events_in") or 0) < len(events) + 40:
            assert submit.poll() is None, (tmp_path / "submit.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the submitted pipeline did not drain its input"
            time.sleep(0.5)
    finally:
        submit.send_signal(signal.SIGTERM)
        submit.wait(90)
    stats = {k.decode(): v.decode() for k, v in r.hgetall(STATS_KEY).items()}
    assert int(stats["events_aggregated"]) == len(events)
    assert int(stats["audit_ok"]) == int(stats["batches"])
