"""Hot standby, with real processes: two `sluice run -c same.yaml` share one checkpoint and one
store; one leads, the other stands by warm and takes over when the leader is killed or paused
past its lease. Counts stay exact and every batch's audit balances (see `pipeline.lease`)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import orjson
import pytest
import redis

from sluice.config import load_config
from sluice.pipeline.query import TOKEN_EPOCH
from sluice.redis.keys import STATS_KEY, stats_keys
from sluice.status.roles import read_roles
from tests.conftest import wait_until
from tests.e2e.test_crash import SteadyProducer, assert_exact, steady_config

pytestmark = [pytest.mark.spark, pytest.mark.slow]
SLUICE = [sys.executable, "-m", "sluice.cli"]
KILLS = 2  # each but the last costs ~40-60 s here: a new `sluice run` to start and warm up as
# the standby; two kills make the two processes lead in turn, each once after a kill
TAKEOVER_S = 20.0  # from the kill to the new leader's first batch; a cold start takes ~45 s


def _config(tmp_path: Path, redis_url: str, state: str = "state") -> Path:
    return steady_config(tmp_path, redis_url, state, lease={"ttl": "2s"})


class Processes:
    """The `sluice run` processes of one test, each in its own process group (its JVM and
    Python workers with it), and their logs."""

    def __init__(self, r: redis.Redis, cfg_path: Path, tmp_path: Path) -> None:
        self.r = r
        self.cfg_path = cfg_path
        self.cfg = load_config(cfg_path)
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[str]] = []

    def start(self) -> subprocess.Popen[bytes]:
        log = (self.tmp_path / f"run-{len(self.procs)}.log").open("w")
        self.logs.append(log)
        proc = subprocess.Popen(
            [*SLUICE, "run", "-c", str(self.cfg_path)], stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return (self.tmp_path / f"run-{self.procs.index(proc)}.log").read_text()

    def roles(self) -> dict[str, Any]:
        return read_roles(self.r, self.cfg, time.time_ns() // 1_000_000)

    def role_of(self, proc: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        return next((p for p in self.roles()["processes"] if p["pid"] == proc.pid), None)

    def wait_leader(self, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
        def leads() -> bool:
            leader = self.roles()["leader"]
            return leader is not None and leader["pid"] == proc.pid

        wait_until(leads, timeout_s, f"pid {proc.pid} to lead")

    def start_pair(
        self, timeout_s: float = 180
    ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
        """Start two processes at once (their JVMs start side by side) and wait until one
        leads; returns (leader, the other). Which one wins the lease is up to the race."""
        pair = (self.start(), self.start())

        def leader_pid() -> int | None:
            for proc in pair:
                assert proc.poll() is None, self.log_of(proc)
            leader = self.roles()["leader"]
            return None if leader is None else int(leader["pid"])

        # a killed leader is shown until its lease lapses
        wait_until(lambda: leader_pid() in (pair[0].pid, pair[1].pid), timeout_s,
                   "one of two processes to lead")  # fmt: skip
        return pair if leader_pid() == pair[0].pid else (pair[1], pair[0])

    def wait_standby(
        self, proc: subprocess.Popen[bytes], timeout_s: float = 180, warm: bool = True
    ) -> None:
        """Wait until `proc` stands by; with `warm`, until its first warm-up also ran."""

        def standing_by() -> bool:
            assert proc.poll() is None, self.log_of(proc)
            p = self.role_of(proc)
            return p is not None and p["role"] == "standby" and (p["warm"] or not warm)

        what = f"pid {proc.pid} to stand by" + (" warm" if warm else "")
        wait_until(standing_by, timeout_s, what)

    def wait_warm_standby(self, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
        self.wait_standby(proc, timeout_s)

    def events_in(self) -> int:
        return int(self.r.hget(STATS_KEY, "events_in") or 0)

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for log in self.logs:
            log.close()


def _drain(ps: Processes, producer: SteadyProducer) -> None:
    producer.stop.set()
    producer.join(10)
    wait_until(lambda: ps.events_in() >= producer.events, 240, "the backlog to drain")
    time.sleep(1.0)  # anything counted twice would show up as more than produced


def _stop(ps: Processes) -> None:
    """SIGTERM to each running process: each exits 0 and leaves nothing of its group behind
    (its JVM, its Python workers, an armed query's planner)."""
    running = [p for p in ps.procs if p.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    for proc in running:
        assert proc.wait(60) == 0, ps.log_of(proc)
    for proc in running:
        wait_until(lambda p=proc: not _group_alive(p.pid), 30, f"group {proc.pid} to end")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_standby_takes_over_from_a_killed_leader_each_time(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """SIGKILL of the leader, KILLS times under load; the killed process comes back as the
    standby, so the two take turns leading. Each time the standby leads within TAKEOVER_S.
    Then both are killed together and started again: nothing is lost or counted twice."""
    ps = Processes(r, _config(tmp_path, redis_url), tmp_path)
    producer = SteadyProducer(r)
    rng = random.Random(20261124)
    takeovers: list[float] = []
    try:
        leader, standby = ps.start_pair()
        ps.wait_warm_standby(standby)
        assert 'msg="pipeline role" role=leader' in ps.log_of(leader)
        assert 'msg="pipeline role" role=standby' in ps.log_of(standby)
        producer.start()
        for kill in range(KILLS):
            before = ps.events_in()
            wait_until(lambda b=before: ps.events_in() > b, 60, "a batch by the leader")
            time.sleep(rng.uniform(0.0, 0.6))  # anywhere in or between batches
            leader.send_signal(signal.SIGKILL)  # its JVM goes once its driver is gone
            killed_at, at_kill = time.monotonic(), ps.events_in()
            ps.wait_leader(standby, TAKEOVER_S)
            wait_until(lambda n=at_kill: ps.events_in() > n, TAKEOVER_S, "the new leader's batch")
            takeovers.append(time.monotonic() - killed_at)
            # It had started its query ahead (armed) and only let it go (docs/spark.md).
            firsts = [ln for ln in ps.log_of(standby).splitlines() if 'msg="first batch"' in ln]
            assert firsts and "armed=True" in firsts[-1], firsts
            leader.wait(30)
            with contextlib.suppress(ProcessLookupError):  # whatever of its group is left
                os.killpg(leader.pid, signal.SIGKILL)
            leader, standby = standby, ps.start()
            # A takeover must find the standby warm; the power cut below only needs it to
            # have joined (its warm-up writes nothing), which saves a warm-up under load.
            ps.wait_standby(standby, warm=kill < KILLS - 1)
        # Both stopped together (a power cut), the producer going on; then both started again.
        for proc in (leader, standby):
            os.killpg(proc.pid, signal.SIGKILL)
        for proc in (leader, standby):
            proc.wait(30)
        at_outage = ps.events_in()
        leader, standby = ps.start_pair()
        wait_until(lambda: ps.events_in() > at_outage, 180, "a batch after both were started again")
        _drain(ps, producer)  # the restart is done; the standby warms up without the load
        ps.wait_warm_standby(standby)
        _stop(ps)
    finally:
        producer.stop.set()
        ps.close()
    print(f"takeovers (kill -> first batch of the new leader): {takeovers}")
    assert len(takeovers) == KILLS and max(takeovers) < TAKEOVER_S
    assert_exact(r, producer)


def test_a_paused_leader_loses_its_lease_and_commits_nothing_after(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """SIGSTOP of the leader's whole process group (its JVM too: a long GC, a frozen VM) for
    longer than the lease; the standby takes over. After SIGCONT the old leader finds its lease
    taken, stops its queries and stands by: no batch is counted twice and each batch is
    recorded once, in order. A third process with another state_dir is refused meanwhile."""
    ps = Processes(r, _config(tmp_path, redis_url), tmp_path)
    producer = SteadyProducer(r)
    try:
        old, new = ps.start_pair()
        other = subprocess.Popen(
            [*SLUICE, "run", "-c", str(_config(tmp_path, redis_url, "elsewhere"))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:  # refused while `new` warms up
            _, other_err = other.communicate(timeout=120)
        finally:
            if other.poll() is None:
                other.kill()
                other.wait(30)
        assert other.returncode == 1
        assert f"pid {old.pid}) leads query `spark`" in other_err, other_err
        assert "same `state_dir`" in other_err and "Traceback" not in other_err
        ps.wait_warm_standby(new)
        producer.start()
        before = ps.events_in()
        wait_until(lambda: ps.events_in() > before, 60, "a batch by the leader")
        old_epoch = ps.roles()["leader"]["epoch"]
        os.killpg(old.pid, signal.SIGSTOP)
        try:
            ps.wait_leader(new, TAKEOVER_S)
            at = ps.events_in()
            wait_until(lambda: ps.events_in() > at, TAKEOVER_S, "a batch by the new leader")
            new_epoch = ps.roles()["leader"]["epoch"]
        finally:
            os.killpg(old.pid, signal.SIGCONT)
        wait_until(lambda: (ps.role_of(old) or {}).get("role") == "standby", 60,
                   "the old leader to stand by")  # fmt: skip
        at = ps.events_in()
        wait_until(lambda: ps.events_in() > at, 30, "a batch after the old leader woke")
        _drain(ps, producer)
        _stop(ps)
    finally:
        producer.stop.set()
        ps.close()
    assert "leadership lost" in ps.log_of(old)
    # said once, in that line: not again by py4j and Spark, each with the batch's traceback
    assert "sluice.errors.LeaseLost" not in ps.log_of(old)
    assert "CONCURRENT_STREAM_LOG_UPDATE" not in ps.log_of(new)
    assert new_epoch > old_epoch
    assert_exact(r, producer)
    # Each batch was recorded once (the records are newest first), and once the new leader's
    # term began no batch was written with the old leader's epoch.
    recs = [orjson.loads(x) for x in r.lrange(stats_keys().batches, 0, -1)][::-1]
    ids = [rec["batch"] for rec in recs]
    assert ids == sorted(set(ids))
    epochs = [rec["token"] // TOKEN_EPOCH for rec in recs]
    assert epochs == sorted(epochs) and old_epoch in epochs and new_epoch in epochs
