"""The leadership lease and its fencing (`sluice.pipeline.lease`), on a real Redis, with a manual
clock: who may take a lease when, which epoch each batch writes with across terms, and the
refusal of a second checkpoint over the same queries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from redis.crc import key_slot

from sluice.clock import ManualClock
from sluice.errors import LeaderConflict, LeaseLost
from sluice.flow.board import Board
from sluice.pipeline.health import Health
from sluice.pipeline.lease import Claim, Keeper, Lease, last_planned
from sluice.pipeline.query import writer_token
from sluice.pipeline.standby import announce
from sluice.redis.keys import EPOCH_KEY, HEALTH_KEY, PROCESSES_KEY
from sluice.redis.local_cluster import LocalCluster
from sluice.server.app import create_app
from sluice.status.roles import read_roles
from sluice.status.snapshot import pipeline_health
from sluice.status.views import format_status
from tests.conftest import make_config

TTL_MS = 2_000


def _lease(r: redis.Redis, ckpt: Path, clock: ManualClock, pid: int, query: str = "spark") -> Lease:
    return Lease(r, [Claim(query, ckpt)], TTL_MS, clock, host="h", pid=pid)


def _plan(ckpt: Path, batch: int) -> None:
    """What Spark does before running a batch: its offset log entry."""
    (ckpt / "offsets").mkdir(parents=True, exist_ok=True)
    (ckpt / "offsets" / str(batch)).write_text("v1\n{}\n{}\n")


def test_one_process_leads_and_the_other_takes_over_once_the_lease_lapses(
    r: redis.Redis, tmp_path: Path
) -> None:
    clock = ManualClock(1_000_000)
    ckpt = tmp_path / "checkpoint"
    a, b = _lease(r, ckpt, clock, 1), _lease(r, ckpt, clock, 2)
    assert a.try_acquire() is None and a.epoch is not None
    holder = b.try_acquire()
    assert holder is not None and holder.pid == 1 and holder.epoch == a.epoch
    assert b.epoch is None
    epochs_taken = int(r.get(EPOCH_KEY) or 0)
    for _ in range(5):  # polling a busy lease takes no epoch
        clock.advance(250)
        assert b.try_acquire() is not None
    assert int(r.get(EPOCH_KEY) or 0) == epochs_taken
    clock.advance(TTL_MS - 1_000)  # 1,250 ms after a's last renewal: still a's ...
    assert a.renew()
    clock.advance(TTL_MS - 1)
    assert b.try_acquire() is not None  # ... and renewed: 1 ms short of lapsing
    clock.advance(2)
    assert b.try_acquire() is None  # lapsed: b's term, with a higher epoch
    assert b.epoch is not None and a.epoch is not None and b.epoch > a.epoch
    assert not a.renew() and a.lost.is_set()
    with pytest.raises(LeaseLost, match="another process holds it"):
        a.check("spark")


def test_a_standby_takes_over_at_once_when_the_leaders_connection_closes(
    r: redis.Redis, tmp_path: Path
) -> None:
    """A killed leader's lease connection closes with its process: no need to wait for the
    ttl, once the name is missing from CLIENT LIST twice in a row."""
    clock = ManualClock(1_000)
    a, b = _lease(r, tmp_path / "c", clock, 1), _lease(r, tmp_path / "c", clock, 2)
    assert a.try_acquire() is None
    assert b.try_acquire() is not None  # a's connection is open: a leads
    a._named.connection_pool.disconnect()  # what the kernel does to a killed process's sockets
    assert b.try_acquire() is not None  # missing once: maybe a reconnect
    assert b.try_acquire() is None  # missing twice: a is gone, b leads (no time passed)
    assert b.epoch is not None and a.epoch is not None and b.epoch > a.epoch
    assert not a.renew()  # a, had it been alive, now learns it lost


def test_the_holder_counts_its_lease_valid_for_less_than_the_ttl(
    r: redis.Redis, tmp_path: Path
) -> None:
    clock = ManualClock(5_000)
    lease = _lease(r, tmp_path / "c", clock, 1)
    assert lease.try_acquire() is None
    assert lease.valid()
    clock.advance(int(TTL_MS * 0.75) + 1)
    assert not lease.valid()
    lease.check("spark")  # renews first: nobody took it meanwhile
    assert lease.valid()


def test_a_clean_stop_releases_the_lease_at_once(r: redis.Redis, tmp_path: Path) -> None:
    clock = ManualClock(5_000)
    a, b = _lease(r, tmp_path / "c", clock, 1), _lease(r, tmp_path / "c", clock, 2)
    assert a.try_acquire() is None
    a.release()
    assert b.try_acquire() is None


def test_a_batch_keeps_the_epoch_of_the_term_that_first_ran_it(
    r: redis.Redis, tmp_path: Path
) -> None:
    """Old leader a runs batches 0-2 and is paused in batch 2; b takes over. b re-runs batch 2
    with a's epoch (so the writes of both attempts share one token), and writes batch 3 and
    later with its own. a, waking up, gets no epoch for a batch it had not started."""
    clock = ManualClock(1_000)
    ckpt = tmp_path / "checkpoint"
    a, b = _lease(r, ckpt, clock, 1), _lease(r, ckpt, clock, 2)
    assert a.try_acquire() is None
    claim = a.claims[0]
    a.begin(claim)
    for batch in range(3):
        _plan(ckpt, batch)
        assert a.batch_epoch(claim, batch) == a.epoch
    clock.advance(TTL_MS + 1)  # a is paused past its lease
    assert b.try_acquire() is None
    assert a.epoch is not None and b.epoch is not None
    b.begin(claim)
    assert b.batch_epoch(claim, 2) == a.epoch  # the re-run of a's batch in flight
    _plan(ckpt, 3)
    assert b.batch_epoch(claim, 3) == b.epoch
    assert b.batch_epoch(claim, 2) == a.epoch  # asked again: the same answer
    with pytest.raises(LeaseLost):
        a.batch_epoch(claim, 4)
    tokens = [writer_token(b.batch_epoch(claim, n), n) for n in range(4)]
    assert tokens == sorted(tokens)  # every later batch outranks the earlier ones


def test_a_checkpoint_from_before_terms_keeps_its_epoch_for_the_batches_it_planned(
    r: redis.Redis, tmp_path: Path
) -> None:
    """An upgrade: a checkpoint whose batches were written with its own epoch (the file beside
    it) re-runs its last planned batch with that epoch, and writes new ones with the term's."""
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "sluice-epoch").write_text("3")
    r.set(EPOCH_KEY, 3)
    for batch in range(8):
        _plan(ckpt, batch)
    assert last_planned(ckpt) == 7
    lease = _lease(r, ckpt, ManualClock(1_000), 1)
    assert lease.try_acquire() is None
    lease.begin(lease.claims[0])
    assert lease.epoch is not None and lease.epoch > 3
    assert lease.batch_epoch(lease.claims[0], 7) == 3
    _plan(ckpt, 8)
    assert lease.batch_epoch(lease.claims[0], 8) == lease.epoch


def test_a_second_checkpoint_over_the_same_queries_is_refused(
    r: redis.Redis, tmp_path: Path
) -> None:
    clock = ManualClock(1_000)
    a = _lease(r, tmp_path / "one" / "checkpoint", clock, 1)
    b = _lease(r, tmp_path / "two" / "checkpoint", clock, 2)
    assert a.try_acquire() is None
    with pytest.raises(LeaderConflict, match=r"pid 1\) leads query `spark`.*same `state_dir`"):
        b.try_acquire()
    with pytest.raises(LeaderConflict, match="pid 1"):
        b.probe()  # what `sluice run` asks before it starts Spark: reads only
    same = _lease(r, tmp_path / "one" / "checkpoint", clock, 3)
    same.probe()
    assert same.try_acquire() is not None  # the same checkpoint: a standby
    clock.advance(TTL_MS + 1)
    b.probe()  # a lapsed lease conflicts with nobody


def test_a_process_takes_all_its_leases_or_none(r: redis.Redis, tmp_path: Path) -> None:
    clock = ManualClock(1_000)
    a = Lease(r, [Claim("spark", tmp_path / "c1")], TTL_MS, clock, host="h", pid=1)
    both = [Claim("spark", tmp_path / "c1"), Claim("enrich", tmp_path / "c2")]
    b = Lease(r, both, TTL_MS, clock, host="h", pid=2)
    assert a.try_acquire() is None
    assert b.try_acquire() is not None
    assert r.hget("sluice:{lease}:q:enrich", "owner") is None  # nothing taken


def test_the_keeper_reports_a_lost_lease(r: redis.Redis, tmp_path: Path) -> None:
    clock = ManualClock(1_000)
    a, b = _lease(r, tmp_path / "c", clock, 1), _lease(r, tmp_path / "c", clock, 2)
    a.ttl_ms = 400  # a keeper that renews every 100 ms (the manual clock does not move)
    assert a.try_acquire() is None
    clock.advance(10_000)
    assert b.try_acquire() is None
    reasons: list[str] = []
    keeper = Keeper(a, reasons.append)
    keeper.start()
    keeper.join(5)
    assert reasons == ["another process holds it"] and a.lost.is_set()


def test_status_shows_each_process_role_and_lease_age(r: redis.Redis, tmp_path: Path) -> None:
    clock = ManualClock(1_000_000)
    cfg = make_config("redis://unused", tmp_path)
    a, b = _lease(r, tmp_path / "c", clock, 11), _lease(r, tmp_path / "c", clock, 12)
    assert a.try_acquire() is None and b.try_acquire() is not None
    announce(r, a, "leader", {"started_ms": clock.now_ms()})
    announce(r, b, "standby", {"started_ms": clock.now_ms(), "warm": True})
    clock.advance(300)
    roles = read_roles(r, cfg, clock.now_ms())
    by_pid = {p["pid"]: p for p in roles["processes"]}
    assert by_pid[11]["role"] == "leader" and by_pid[11]["lease_age_ms"] == 300
    assert by_pid[12]["role"] == "standby" and by_pid[12]["lease_age_ms"] is None
    assert roles["leader"]["pid"] == 11 and roles["leader"]["epoch"] == a.epoch
    # The same, as `sluice status`, `/v1/status` and `/healthz` show it.
    api = TestClient(create_app(cfg, r, clock=clock))
    health = api.get("/healthz").json()["processes"]
    assert [(p["role"], p["host"], p["pid"], p["lease_age_ms"]) for p in health] == [
        ("leader", "h", 11, 300),
        ("standby", "h", 12, None),
    ]
    status = api.get("/v1/status").json()
    assert status["roles"]["leader"]["pid"] == 11
    text = format_status(status)
    assert f"leader on h, pid 11, epoch {a.epoch}, lease renewed 300 ms ago" in text
    assert "standby on h, pid 12, warm" in text
    clock.advance(10_000)  # neither beats any more: both left out
    assert read_roles(r, cfg, clock.now_ms())["processes"] == []
    assert r.hlen(PROCESSES_KEY) == 2
    # A lease released by a clean stop has no expiry left: null, not minus the epoch's ms.
    leases = read_roles(r, cfg, clock.now_ms())["leases"]
    assert leases and all(x["expires_in_ms"] < 0 and not x["live"] for x in leases.values())
    a.release()
    leases = read_roles(r, cfg, clock.now_ms())["leases"]
    assert leases and all(x["expires_in_ms"] is None and not x["live"] for x in leases.values())


def test_on_a_cluster_a_standby_takes_over_at_once_too(rc: Any, tmp_path: Path) -> None:
    """The named connection goes to the `{lease}` slot's master: a standby sees a killed
    leader's connection gone there, as on one Redis, without waiting for the ttl."""
    clock = ManualClock(1_000)
    a, b = _lease(rc, tmp_path / "c", clock, 1), _lease(rc, tmp_path / "c", clock, 2)
    assert a._named is not None and a.try_acquire() is None
    assert b.try_acquire() is not None
    a._named.connection_pool.disconnect()
    assert b.try_acquire() is not None  # missing once: maybe a reconnect
    assert b.try_acquire() is None  # missing twice: a is gone (no time passed)
    assert b.epoch is not None and a.epoch is not None and b.epoch > a.epoch


def test_on_a_cluster_the_leases_connection_follows_its_slot(
    rc: Any, redis_cluster: LocalCluster, tmp_path: Path
) -> None:
    """The `{lease}` slot moves to another master (resharding): the holder is still found
    where its connection is, follows the slot at its next call, and keeps its lease; a standby
    takes over only once that connection closes."""
    clock = ManualClock(1_000)
    a, b = _lease(rc, tmp_path / "c", clock, 1), _lease(rc, tmp_path / "c", clock, 2)
    assert a.try_acquire() is None
    slot = key_slot(a.keys[0].encode())
    home = redis_cluster.node_of_slot(slot)
    try:
        redis_cluster.migrate_slot(slot, (home + 1) % redis_cluster.masters)
        for _ in range(3):  # the holder has not followed yet: its connection is still found
            assert b.try_acquire() is not None
        clock.advance(500)
        assert a.renew()  # MOVED: the connection follows the slot, and the renewal lands
        port = a._named.connection_pool.connection_kwargs["port"]
        assert port == redis_cluster.ports[(home + 1) % redis_cluster.masters]
        for _ in range(3):
            assert b.try_acquire() is not None
        a._named.connection_pool.disconnect()
        assert b.try_acquire() is not None
        assert b.try_acquire() is None
    finally:
        redis_cluster.migrate_slot(slot, home)


def test_status_says_not_running_once_the_leaders_lease_lapses(
    r: redis.Redis, tmp_path: Path
) -> None:
    """A leader killed with -9 leaves `running` in the health hash, with a heartbeat that is
    only stale after HEARTBEAT_STALE_MS; its lease lapses within the ttl, and status says so."""
    clock = ManualClock(1_000_000)
    cfg = make_config("redis://unused", tmp_path)
    a = _lease(r, tmp_path / "c", clock, 21)
    assert a.try_acquire() is None
    Health(r, clock, leased=True).set("running")
    spark = {"stage": "spark", "rate": None, "measured_rate": 500.0, "updated_ms": clock.now_ms()}
    Board(r).publish("spark/h/21", spark, False)  # the driver's admission task, last published
    api = TestClient(create_app(cfg, r, clock=clock))
    status = api.get("/v1/status").json()
    assert status["pipeline"]["state"] == "running"
    assert status["rates"]["admitted_events_per_s"] == 500.0
    assert api.get("/healthz").json()["pipeline"] == "running"
    clock.advance(TTL_MS + 1)  # no renewal: the lease lapsed, the heartbeat is 2 s old
    assert pipeline_health(r, clock.now_ms())["state"] == "running"  # the heartbeat alone
    status = api.get("/v1/status").json()
    assert status["pipeline"]["state"] == "not_running"
    assert status["rates"]["admitted_events_per_s"] == 0.0  # not its last rate, frozen
    assert api.get("/healthz").json()["pipeline"] == "not_running"
    assert a.try_acquire() is None  # a new term, and a live lease: running again
    assert api.get("/v1/status").json()["pipeline"]["state"] == "running"
    Health(r, clock, leased=True).set("stopped")
    a.release()
    assert api.get("/v1/status").json()["pipeline"]["state"] == "stopped"
    Health(r, clock).set("running")  # `sluice demo`'s pipeline runs under no lease
    assert api.get("/v1/status").json()["pipeline"]["state"] == "running"


def test_a_standby_says_when_the_leader_folds_another_plan(
    r: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A standby started with a metric more than its leader's: after a takeover that metric
    would count only while this process leads. It says so, naming the metrics, once per
    leader; with the same plan it says nothing."""
    import threading

    from sluice.pipeline.standby import Roles, plan_digests

    cfg = make_config("redis://127.0.0.1:1/0", tmp_path)
    clock = ManualClock(1_000_000)
    ckpt = tmp_path / "checkpoint"
    leader, standby = _lease(r, ckpt, clock, 1), _lease(r, ckpt, clock, 2)
    assert leader.try_acquire() is None
    holder = standby.try_acquire()
    assert holder is not None
    plan = plan_digests(cfg)
    announce(r, leader, "leader", {"plan": {n: d for n, d in plan.items() if n != "qty_sum"}})
    s = Roles([], standby, r, clock, threading.Event(), 0.1)
    s._plan = plan
    with caplog.at_level("WARNING", logger="sluice.pipeline.standby"):
        s._compare_plans(holder)
        s._compare_plans(holder)
    said = [rec for rec in caplog.records if "another plan" in rec.getMessage()]
    assert len(said) == 1 and said[0].__dict__["metrics"] == "qty_sum"
    caplog.clear()
    s._compared = None  # a new leader, with the same plan
    announce(r, leader, "leader", {"plan": plan})
    with caplog.at_level("WARNING", logger="sluice.pipeline.standby"):
        s._compare_plans(holder)
    assert not [rec for rec in caplog.records if "another plan" in rec.getMessage()]


def test_query_restarts_count_on_over_a_process_s_terms_as_leader(r: redis.Redis) -> None:
    """`restarts` is a counter (`sluice_pipeline_restarts_total`): a process that lost its
    lease and leads again (a new Supervisor, given its count by the standby) goes on from its
    count, where it started again from 0."""
    import threading

    from sluice.pipeline.supervisor import Supervisor

    stopped = threading.Event()
    stopped.set()  # a term that ends at once: only the count is looked at
    term = Supervisor([], r, ManualClock(1_000), stopped, restarts=3)
    term.run_forever()
    assert term.restarts == 3
    assert r.hget(HEALTH_KEY, "restarts") == b"3"
