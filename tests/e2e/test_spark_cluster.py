"""`sluice run` on a real Spark standalone cluster (a master and workers, separate JVMs on
loopback): Sluice ships its own code to the executors, a worker added while the pipeline runs
gets an executor that runs tasks, and the oracle check of test_oracle holds for every metric."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import yaml

from sluice.config import config_from_dict
from sluice.redis.keys import STATS_KEY
from sluice.source.loadgen import produce_frame
from sluice.source.producer import Producer
from sluice.testing.standalone import StandaloneCluster
from tests.conftest import config_data
from tests.e2e.test_oracle import check_answers, make_events, produce

pytestmark = [pytest.mark.spark, pytest.mark.slow]
N_EVENTS = 120_000
BACKLOG = 40_000  # written before the run starts: batches are folding as the worker joins
STEP = 1_000  # then written a step per batch, until the added worker's executor starts a task


def events_in(r: redis.Redis) -> int:
    return int(r.hget(STATS_KEY, "events_in") or 0)


def wait_for(ok: Callable[[], bool], run: subprocess.Popen[bytes], log: Path, what: str) -> None:
    """Poll `ok()` while `sluice run` lives (its log's tail if it exits); fail after 300 s."""
    deadline = time.monotonic() + 300
    while not ok():
        assert run.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_worker_added_while_the_pipeline_runs_gets_tasks_and_the_answers_match_the_reference(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Start on 1 worker with `spark.cores.max` 2, add a worker mid-run: the master gives the
    running application an executor there, and that executor runs tasks; nothing is lost or
    counted twice. The input is not allowed to run out first: after the backlog it arrives a
    step per batch until the new executor has started a task, and only then does the rest."""
    now = time.time_ns() // 1_000_000
    events = make_events(now, N_EVENTS)
    with StandaloneCluster(tmp_path / "spark", workers=1, cores=1) as cluster:
        data = config_data(
            redis_url,
            tmp_path / "state",
            source={"max_events_per_batch": 10_000},
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
        produce(cfg, r, events.iloc[:BACKLOG], now)  # with the 40 malformed entries
        producer = Producer.from_config(cfg, r, batch_events=500)
        shard_by = producer.shard_by
        log = tmp_path / "run.log"
        run = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "run", "-c", str(path)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: events_in(r) > 0, run, log, "no batch was folded on 1 worker")
            (app,) = cluster.state()["activeapps"]
            assert app["name"] == "sluice" and app["cores"] == 1, app  # all that 1 worker has
            added = cluster.add_worker()
            written = BACKLOG

            def new_executor_ran_a_task() -> bool:
                """True once the added worker's executor has started a task; until then a step
                more input each time the pipeline has taken in all that was written."""
                nonlocal written
                if cluster.tasks_started(added, app["id"]):
                    return True
                assert written < N_EVENTS, "the input ran out before the new executor ran a task"
                if events_in(r) >= written + 40:  # + the 40 malformed events of the backlog
                    produce_frame(producer, events.iloc[written : written + STEP], shard_by)
                    written += STEP
                return False

            wait_for(new_executor_ran_a_task, run, log, "the added worker's executor ran no task")
            for start in range(written, N_EVENTS, 20_000):
                produce_frame(producer, events.iloc[start : start + 20_000], shard_by)
            wait_for(lambda: events_in(r) >= N_EVENTS + 40, run, log, "the input was not drained")
            (app,) = cluster.state()["activeapps"]
            assert app["cores"] == 2, app
            assert (cluster.worker_state(added) or {}).get("coresused") == 1, cluster.state()
        finally:
            run.send_signal(signal.SIGTERM)
            assert run.wait(90) == 0, (tmp_path / "run.log").read_text()[-3000:]
        # Each worker ran an executor of the application, and each received Sluice as the
        # shipped zip: the added one too, though it joined after the driver shipped it.
        for i in range(2):
            shipped = list(cluster.worker_dir(i).glob(f"{app['id']}/*/sluice-*.zip"))
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
