"""The role of one `sluice run` process: the leader, or a hot standby.

A process first tries to take the leases; while another process holds them it is a standby. It
keeps its Spark session warm: the JVM, the streaming frames, the batch plan run as a streaming
query over made-up events (`StreamQuery.warm_up`, `source.warm`), in a thread beside the
polls: a leader that goes during the first warm-up is taken over at once (cold), not after it.
The warm-up is repeated every WARM_EVERY_S, so its Python workers stay alive; a stop waits for
one in flight before the session stops (Spark logs a crashed Python worker when its session
stops under a batch). Once warm, it starts
its queries *armed* (`StreamQuery.arm`, `source.arm`): Spark starts each one's source planner, a
Python process, and waits before reading the checkpoint, so a takeover skips those seconds. It
polls the leases of its queries (`pipeline.lease`) every `poll_s`, and takes them as soon as
they lapse: it then leads, and lets its armed queries go (or starts them) from the shared
checkpoint. A leader renews its lease from a thread (`lease.Keeper`); if it loses it (another
process took it over while this one was paused or cut off), it stops its queries at once and
stands by again. A clean stop releases the lease, so a standby takes over without waiting for it
to lapse.

Each change of role is logged (`msg="pipeline role"`), and the process keeps its entry in the
process registry for the status views (`announce`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from sluice.clock import Clock
from sluice.errors import LeaderConflict
from sluice.pipeline.fold import WARM_UP_TIMEOUT_S
from sluice.pipeline.lease import Holder, Keeper, Lease
from sluice.pipeline.query import StreamQuery
from sluice.pipeline.supervisor import Supervisor
from sluice.redis.keys import PROCESSES_KEY

log = logging.getLogger(__name__)

WARM_EVERY_S = 30.0  # Spark stops Python workers that stay idle for a minute
ANNOUNCE_EVERY_S = 1.0
PRUNE_AFTER_MS = 60_000  # registry entries of processes gone this long are removed


class Roles:
    """Stand by, lead, stand by again, until `stop` is set. `run` blocks; it raises
    LeaderConflict when another checkpoint leads the same queries."""

    def __init__(
        self,
        queries: Sequence[StreamQuery],
        lease: Lease,
        client: Any,
        clock: Clock,
        stop: threading.Event,
        poll_s: float,
    ) -> None:
        self.queries = list(queries)
        self._restarts = 0
        self.lease = lease
        self.client = client
        self.clock = clock
        self.stop = stop
        self.poll_s = poll_s
        self.role = "starting"
        self.supervisor: Supervisor | None = None
        self._warm_at = 0.0
        self._arm_at = 0.0
        self.warm = False  # the warm-up batch ran at least once
        self._warm_thread: threading.Thread | None = None
        self._announced_at = 0.0
        self._pruned_at = 0.0
        self._holder: Holder | None = None
        self._started_ms = clock.now_ms()
        self._plan = plan_digests(queries[0].cfg) if queries else {}
        self._compared: str | None = None  # the leader whose plan was compared with this one's

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    holder = self.lease.try_acquire()
                except LeaderConflict:
                    raise
                except Exception as e:  # noqa: BLE001 - Redis unreachable: stand by, retry
                    self._standby(None, f"cannot reach the lease: {e}")
                    continue
                if holder is None:
                    self._lead()
                else:
                    self._standby(holder)
        finally:
            self._end_warm_up()
            for q in self.queries:
                q.disarm()
            if self.role == "leader":
                self.lease.release()
            withdraw(self.client, self.lease)

    def _standby(self, holder: Holder | None, problem: str | None = None) -> None:
        was = self._holder.owner if self._holder is not None else None
        if self.role != "standby" or (holder is not None and holder.owner != was):
            extra: dict[str, Any] = {"role": "standby"}
            if holder is not None:
                extra.update(leader=f"{holder.host}:{holder.pid}", leader_epoch=holder.epoch)
            if problem:
                extra["error"] = problem
            log.info("pipeline role", extra=extra)
        self.role, self._holder = "standby", holder
        if holder is not None:
            self._compare_plans(holder)
        self._announce()
        if time.monotonic() >= self._warm_at and not self._warming():
            # beside the polls, never before them: a leader that goes during a warm-up (the
            # first takes 10-30 s) is taken over at once, cold, and this process stays listed
            self._warm_thread = threading.Thread(target=self._warm, daemon=True,
                                                 name="sluice-warm-up")  # fmt: skip
            self._warm_thread.start()
        if self.warm and time.monotonic() >= self._arm_at and not self.stop.is_set():
            self._arm()
        self.stop.wait(self.poll_s)

    def _arm(self) -> None:
        t0 = time.perf_counter()
        try:
            armed = [q.arm() for q in self.queries]
            if any(armed):
                took = round((time.perf_counter() - t0) * 1000)
                log.info("standby armed", extra={"queries": len(self.queries), "arm_ms": took})
        except Exception as e:  # noqa: BLE001 - a takeover then starts its queries cold
            log.warning("could not start the queries ahead of a takeover",
                        extra={"error": str(e)})  # fmt: skip
            self._arm_at = time.monotonic() + WARM_EVERY_S

    def _warming(self) -> bool:
        return self._warm_thread is not None and self._warm_thread.is_alive()

    def _end_warm_up(self) -> None:
        """Wait for a re-warm-up in flight: the caller stops the Spark session next, and a
        session stopped under a running batch makes Spark log its Python worker's crash."""
        t = self._warm_thread
        if t is not None and t.is_alive():
            log.debug("waiting for the standby's warm-up to end")
            t.join(WARM_UP_TIMEOUT_S)

    def _warm(self) -> None:
        t0 = time.perf_counter()
        try:
            for q in self.queries:
                if self.stop.is_set() or self.role == "leader":  # stopping, or took over: the
                    return  # queries run; `_end_warm_up` waits for one query's at most
                q.warm_up()
        except Exception as e:  # noqa: BLE001 - a cold takeover is slower, not wrong
            log.warning("standby warm-up failed", extra={"error": str(e)})
        else:
            self.warm = True
            took = round((time.perf_counter() - t0) * 1000)
            if self.role != "leader":  # a takeover during its last query's warm-up: leading
                level = logging.INFO if self._warm_at == 0.0 else logging.DEBUG
                log.log(level, "standby warm", extra={"warm_up_ms": took})
        self._warm_at = time.monotonic() + WARM_EVERY_S

    def _lead(self) -> None:
        """Lead until `stop` or the lease is lost; the queries are stopped either way."""
        self.role = "leader"
        log.info("pipeline role", extra={"role": "leader", "epoch": self.lease.epoch,
                                         "took_over_from": self._took_over_from()})  # fmt: skip
        self._announce(force=True)
        for q in self.queries:
            q.lease = self.lease
        probe = JvmProbe(
            self.queries[0].spark.sparkContext._jvm,
            self.lease.renew_every_s,
            self.lease.ttl_ms / 1000,
        )
        probe.start()
        keeper = Keeper(self.lease, self._on_lost, probe.stalled)
        keeper.start()
        announcer = threading.Thread(target=self._announce_while_leading, daemon=True,
                                     name="sluice-announce")  # fmt: skip
        announcer.start()
        self.supervisor = Supervisor(self.queries, self.client, self.clock, self.stop, self.lease,
                                     self._restarts)  # fmt: skip
        try:
            self.supervisor.run_forever()
        finally:
            self._restarts = self.supervisor.restarts  # a counter over this process's terms
            keeper.stop()
            probe.stop()
            for q in self.queries:
                q.lease = None
        if self.lease.lost.is_set() and not self.stop.is_set():
            self.role = "lost"
            self._holder = None

    def _took_over_from(self) -> str | None:
        h = self._holder
        return f"{h.host}:{h.pid}" if h is not None else None

    def _on_lost(self, reason: str) -> None:
        log.warning("leadership lost; stopping the queries", extra={"reason": reason})

    def _announce_while_leading(self) -> None:
        while self.role == "leader" and not self.stop.is_set() and not self.lease.lost.is_set():
            self._announce()
            self.stop.wait(ANNOUNCE_EVERY_S)

    def _compare_plans(self, holder: Holder) -> None:
        """Warn when the leader folds other metrics than this process would: after a takeover
        each folds its own, so a metric only one of them has counts only while that one leads
        (a rolling change of sluice.yaml passes through this, briefly, on purpose). Once per
        leader."""
        if holder.owner == self._compared:
            return
        try:
            raw = self.client.hget(PROCESSES_KEY, holder.owner)
        except Exception:  # noqa: BLE001 - compared on the next poll
            return
        theirs = orjson.loads(raw).get("plan") if raw else None
        if theirs is None:
            return  # not announced yet, or a version that does not say
        self._compared = holder.owner
        differ = sorted(n for n in {*theirs, *self._plan} if theirs.get(n) != self._plan.get(n))
        if differ:
            log.warning(
                "the leader folds another plan than this standby: after a takeover each folds"
                " its own, so these metrics count only while a process that has them leads;"
                " give both processes the same sluice.yaml",
                extra={"leader": f"{holder.host}:{holder.pid}", "metrics": ",".join(differ)},
            )

    def _announce(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._announced_at < ANNOUNCE_EVERY_S:
            return
        if now - self._pruned_at > PRUNE_AFTER_MS / 2000:
            self._pruned_at = now
            prune(self.client, self.clock.now_ms())
        self._announced_at = now
        state_dir = Path(self.queries[0].cfg.state_dir).resolve()
        fields = {"started_ms": self._started_ms, "checkpoint": str(state_dir),
                  "warm": self.warm, "plan": self._plan}  # fmt: skip
        announce(self.client, self.lease, self.role, fields)


class JvmProbe(threading.Thread):
    """Asks the Spark driver's JVM for its clock every `every_s`, from a thread of its own, while
    this process leads. The lease is renewed by this (Python) process, so a JVM that stopped
    answering (SIGSTOP, a long stop-the-world pause, swapped out) would otherwise keep it for
    ever while no batch runs: `stalled` tells the lease's keeper not to renew once a call has
    waited over `limit_s`, or the JVM is gone, and a standby takes over when the lease lapses.
    A JVM that answers again finds its lease taken, and the process stands by."""

    def __init__(self, jvm: Any, every_s: float, limit_s: float) -> None:
        """`jvm`: the driver's py4j view (`SparkContext._jvm`)."""
        super().__init__(name="sluice-jvm-probe", daemon=True)
        self._jvm = jvm
        self.every_s = every_s
        self.limit_s = limit_s
        self._sent: float | None = None  # the monotonic time the call in flight was sent
        self._error: str | None = None
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()

    def run(self) -> None:
        while not self._done.is_set():
            sent = self._sent = time.monotonic()
            try:
                self._jvm.java.lang.System.nanoTime()
                self._error = None
            except Exception as e:  # noqa: BLE001 - py4j: the JVM is gone
                self._error = str(e).splitlines()[0] if str(e) else type(e).__name__
            self._sent = None
            took = time.monotonic() - sent
            if took > self.limit_s:
                log.warning("the Spark driver's JVM did not answer for a while",
                            extra={"took_s": round(took, 1), "limit_s": self.limit_s})  # fmt: skip
            self._done.wait(self.every_s)

    def stalled(self) -> str | None:
        """Why the lease must not be renewed now, or None."""
        sent = self._sent
        if sent is not None and time.monotonic() - sent > self.limit_s:
            return f"the Spark driver's JVM has not answered for over {self.limit_s:g} s"
        if self._error is not None:
            return f"the Spark driver's JVM is unreachable: {self._error}"
        return None


def announce(client: Any, lease: Lease, role: str, fields: dict[str, Any]) -> None:
    """Publish this process in the process registry (`sluice:{lease}:processes`), read by
    the status views. Never raises: presence is for display only."""
    now = lease.clock.now_ms()
    queries = [c.query for c in lease.claims]
    record = {"host": lease.host, "pid": lease.pid, "role": role, "beat_ms": now,
              "epoch": lease.epoch, "queries": queries, **fields}  # fmt: skip
    try:
        client.hset(PROCESSES_KEY, lease.owner, orjson.dumps(record))
    except Exception as e:  # noqa: BLE001 - display only
        log.debug("could not announce the process", extra={"error": str(e)})


def prune(client: Any, now_ms: int) -> None:
    """Remove the registry entries of processes that stopped beating PRUNE_AFTER_MS ago
    (killed: they could not withdraw). Never raises."""
    try:
        stale = [k for k, v in client.hgetall(PROCESSES_KEY).items()
                 if now_ms - int(orjson.loads(v).get("beat_ms", 0)) > PRUNE_AFTER_MS]  # fmt: skip
        if stale:
            client.hdel(PROCESSES_KEY, *stale)
    except Exception as e:  # noqa: BLE001 - display only
        log.debug("could not prune the registry", extra={"error": str(e)})


def withdraw(client: Any, lease: Lease) -> None:
    """Remove this process from the registry (a clean stop). Never raises."""
    try:
        client.hdel(PROCESSES_KEY, lease.owner)
    except Exception as e:  # noqa: BLE001 - display only; stale entries age out
        log.debug("could not withdraw the process", extra={"error": str(e)})


def plan_digests(cfg: Any) -> dict[str, str]:
    """Per metric (derived ones too) a digest of its definition, as the config holds it."""
    defs = [*cfg.metrics, *cfg.derived]
    return {d.name: hashlib.sha1(repr(d).encode()).hexdigest()[:12] for d in defs}
