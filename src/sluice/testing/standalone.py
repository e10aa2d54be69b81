"""A real Spark standalone cluster on loopback: one master and N workers, started from the
pip-installed Spark's `spark-class`, each a separate JVM; more workers can join while it runs.
Used by the cluster test and the cluster benchmark."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyspark

from sluice.testing.ports import free_port

SPARK_HOME = Path(pyspark.__file__).parent
# What an executor logs (at INFO, Spark's default level for it) as it starts a task.
TASK_STARTED = "Running task "


def spark_env() -> dict[str, str]:
    """The environment a Spark daemon or `spark-submit` needs: this Spark, loopback only."""
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_NO_DAEMONIZE": "1",
    }


class StandaloneCluster:
    """`start()` (or `with`) starts the master and `workers` workers of `cores` cores each and
    returns once the master counts them all alive; `add_worker()` starts one more while the
    cluster runs; `stop()` stops every daemon (and with a worker, its executors). Worker `i`
    (in start order, from 0) keeps its executors' directories under `worker_dir(i)`."""

    def __init__(self, root: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.root = root
        self.n_workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.ui_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []  # the master, then the workers
        self.worker_ports: list[int] = []  # worker i's RPC port: how the master names it

    @property
    def master(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def worker_dir(self, i: int) -> Path:
        return self.root / f"worker-{i}"

    def _spawn(self, name: str, *args: str) -> None:
        log = (self.root / f"{name}.log").open("wb")
        cmd = [str(SPARK_HOME / "bin" / "spark-class"), *args]
        self.procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=spark_env(),
                             start_new_session=True)
        )  # fmt: skip

    def _spawn_worker(self) -> int:
        """Start worker `i`, the next one, against the master; returns `i` without waiting."""
        i, port = len(self.worker_ports), free_port()
        self.worker_ports.append(port)
        self._spawn(
            f"worker-{i}", "org.apache.spark.deploy.worker.Worker", self.master,
            "--host", "127.0.0.1", "--port", str(port), "--cores", str(self.cores),
            "--memory", self.memory, "--webui-port", "0", "--work-dir", str(self.worker_dir(i)),
        )  # fmt: skip
        return i

    def state(self) -> dict[str, Any]:
        """The master's JSON view: workers, cores, running and finished applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
        return data

    def worker_state(self, i: int) -> dict[str, Any] | None:
        """The master's entry for worker `i` (`state`, `cores`, `coresused`, …); None while the
        worker has not registered."""
        port = self.worker_ports[i]
        return next((w for w in self.state()["workers"] if w["port"] == port), None)

    def tasks_started(self, i: int, app_id: str = "app-*") -> int:
        """Tasks that executors on worker `i` have started for application `app_id` (a glob:
        any by default), counted in their own logs (`<worker dir>/<app id>/<executor id>/stderr`).
        An executor logs each start at INFO under Spark's default log settings; with
        `spark.executor.extraJavaOptions` naming another log4j2 file this may count nothing."""
        return sum(
            log.read_text(errors="replace").count(TASK_STARTED)
            for log in self.worker_dir(i).glob(f"{app_id}/*/stderr")
        )

    def start(self, timeout_s: float = 120) -> StandaloneCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
            "--port", str(self.port), "--webui-port", str(self.ui_port),
        )  # fmt: skip
        try:
            for _ in range(self.n_workers):
                self._spawn_worker()
            self._await_workers(range(self.n_workers), timeout_s)
        except BaseException:
            self.stop()  # no daemon outlives a start that failed
            raise
        return self

    def add_worker(self, timeout_s: float = 120) -> int:
        """Start one more worker against the running master and block until the master counts
        it alive; returns its index. The master then gives it executors of any application that
        holds fewer cores than its `spark.cores.max`, on its own: the application needs no
        restart. On failure (the worker exits, or does not register in `timeout_s`) it raises
        RuntimeError and leaves the worker to `stop()`; the rest of the cluster runs on."""
        i = self._spawn_worker()
        self._await_workers(range(i, i + 1), timeout_s)
        return i

    def _await_workers(self, workers: range, timeout_s: float) -> None:
        """Poll the master's JSON view until it lists each of `workers` (indices) as alive."""
        ports = {self.worker_ports[i] for i in workers}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                alive = {w["port"] for w in self.state()["workers"] if w["state"] == "ALIVE"}
                if ports <= alive:
                    return
            except (OSError, ValueError):
                pass  # the master's UI is not up yet, or not yet serving its JSON view
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited early; see logs in {self.root}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {list(workers)} did not register in {timeout_s}s")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.procs.clear()
        self.worker_ports.clear()

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
