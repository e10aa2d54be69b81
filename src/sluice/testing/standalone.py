"""A real Spark standalone cluster on loopback: one master and N workers, started from the
pip-installed Spark's `spark-class`, each a separate JVM. Used by the cluster test and the
cluster benchmark."""

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


def spark_env() -> dict[str, str]:
    """The environment a Spark daemon or `spark-submit` needs: this Spark, loopback only."""
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_NO_DAEMONIZE": "1",
    }


class StandaloneCluster:
    def __init__(self, root: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.root = root
        self.n_workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.ui_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

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

    def state(self) -> dict[str, Any]:
        """The master's JSON view: workers, cores, running and finished applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
        return data

    def start(self, timeout_s: float = 120) -> StandaloneCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
            "--port", str(self.port), "--webui-port", str(self.ui_port),
        )  # fmt: skip
        for i in range(self.n_workers):
            self._spawn(
                f"worker-{i}", "org.apache.spark.deploy.worker.Worker", self.master,
                "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                "--webui-port", "0", "--work-dir", str(self.worker_dir(i)),
            )  # fmt: skip
        try:
            self._await_workers(timeout_s)
        except BaseException:
            self.stop()  # no daemon outlives a start that failed
            raise
        return self

    def _await_workers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.state().get("aliveworkers") == self.n_workers:
                    return
            except (OSError, ValueError):
                pass  # the master's UI is not up yet, or not yet serving its JSON view
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited early; see logs in {self.root}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.n_workers} workers did not register in {timeout_s}s")
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

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
