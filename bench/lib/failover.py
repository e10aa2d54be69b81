"""`sluice run` killed with SIGKILL under a paced load, and how fast it comes back.

Each incarnation starts, records its first batch and, after a kill, brings the backlog back to
its pre-kill level; then it runs for a random time and its process group is SIGKILLed and
restarted at once. Redis is sampled every SAMPLE_S. At the end the backlog drains and the
counters and the store are checked against the events produced. Times are wall-clock ms."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from lib.load import LoadPool, PacedProducer, is_busy, now_ms
from lib.procs import SluiceProcess, count_metric_total, stat_counter
from lib.results import log
from lib.stats import median
from sluice.config import config_from_dict
from sluice.flow.board import TIMELINE_LEN, Board
from sluice.graph import SPARK
from sluice.redis.connection import client_for
from sluice.redis.keys import HEALTH_KEY, STATS_KEY
from sluice.status.snapshot import backlog, recent_batches

SAMPLE_S = 0.2
PREKILL_WINDOW_S = 5.0  # pre-kill backlog level = its peak over this long before the kill
FIRST_BATCH_TIMEOUT_S, RECOVER_TIMEOUT_S = 240.0, 180.0
CAUGHT_UP_S = 4.0  # before the steady run: backlog under this many seconds of input
COUNTERS = ("events_in", "batches", "audit_ok", "audit_failed", "audit_replays",
            "events_admitted", "dead_letters", "events_aggregated")  # fmt: skip


class WaitTimeout(RuntimeError):
    """The run waited in vain (the pipeline did not catch up in time)."""


def _s(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else (b - a) / 1000


class Failover:
    """One run: the `sluice run` process, the producer and the sampling loop. `run()` returns
    the results: per incarnation (`cycles`) and at the end."""

    def __init__(self, data: dict[str, Any], root: Path, pool: LoadPool, rate_per_s: float,
                 kills: int, steady_s: tuple[float, float], seed: int) -> None:  # fmt: skip
        self.cfg = config_from_dict(data)
        (root / "sluice.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        self.proc = SluiceProcess(["run", "-c", str(root / "sluice.yaml")], root / "sluice.log")
        self.client = client_for(data["redis"])
        self.per_entry = pool.events_per_entry()
        self.producer = PacedProducer(data["redis"], pool, rate_per_s, retry_busy=True)
        self.rate_per_s, self.kills, self.steady_s = rate_per_s, kills, steady_s
        self.rng = random.Random(seed)
        self.cycles: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.busy_polls = 0
        self.stopped = ""  # why the run made fewer kills than planned

    def look(self) -> dict[str, Any]:
        """Backlog, the last batch record and the supervisor's health, in 2 round trips. Raises
        redis.ResponseError (BUSY) while a long script runs."""
        entries, _ = backlog(self.client, self.cfg)
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(STATS_KEY, "last_batch", "events_in")
        pipe.hmget(HEALTH_KEY, "heartbeat_ms", "changed_ms", "state")
        (last, events_in), (beat, changed, state) = pipe.execute()
        rec = orjson.loads(last) if last else {}
        s = {"t_ms": now_ms(), "backlog": round(entries * self.per_entry),
             "batch": rec.get("batch"), "done_ms": rec.get("done_ms"),
             "events_in": int(events_in or 0), "beat_ms": int(beat or 0),
             "changed_ms": int(changed or 0), "state": (state or b"").decode()}  # fmt: skip
        self.samples.append(s)
        return s

    def wait_for(self, ok: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> Any:
        """Sample every SAMPLE_S until `ok`; RuntimeError if the process or the producer died,
        WaitTimeout after `timeout_s`."""
        deadline, next_log = time.monotonic() + timeout_s, time.monotonic() + 10
        while True:
            try:
                s = self.look()
            except redis.exceptions.ResponseError as e:
                if not is_busy(e):
                    raise
                self.busy_polls, s = self.busy_polls + 1, None
            if s is not None and ok(s):
                return s
            if not self.proc.alive():
                raise RuntimeError(f"`sluice run` exited waiting for {what}: {self.proc.tail()}")
            if self.producer.error is not None:
                raise RuntimeError(f"the producer failed: {self.producer.error}")
            if time.monotonic() > deadline:
                raise WaitTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")
            if s is not None and time.monotonic() > next_log:
                log(f"failover: waiting for {what}; backlog {s['backlog']:,}, {s['state']!r}")
                next_log += 10
            time.sleep(SAMPLE_S)

    def run(self) -> dict[str, Any]:
        """Every kill, then the final drain and the checks."""
        t0_ms = now_ms()
        self.producer.start()
        try:
            try:
                cycle: dict[str, Any] | None = self._spawn(0)
                while cycle is not None:
                    self.cycles.append(cycle)
                    back = self._come_back(cycle)
                    more = back and cycle["index"] < self.kills
                    cycle = self._run_then_kill(cycle["index"] + 1) if more else None
            finally:
                self.producer.stop()
                self.producer.join(timeout=30)
            return {"t0_ms": t0_ms, **self._drain_and_check()}
        finally:
            if self.proc.alive():
                self.proc.stop(timeout_s=30)
            self.client.close()

    def _spawn(self, index: int, **kill: Any) -> dict[str, Any]:
        self.proc.start()
        keys = ("killed_ms", "prekill_level", "backlog_at_kill", "last_batch_at_kill", "ran_s")
        return {"index": index, "spawn_ms": now_ms(), **dict.fromkeys(keys), **kill}

    def _come_back(self, c: dict[str, Any]) -> bool:
        """Wait for the incarnation's first recorded batch, then (after a kill) for the backlog
        to be back at its pre-kill level. False if it was not back within RECOVER_TIMEOUT_S."""
        spawn = c["spawn_ms"]
        s = self.wait_for(lambda s: (s["done_ms"] or 0) > spawn, FIRST_BATCH_TIMEOUT_S,
                          f"the first batch of start {c['index'] + 1}")  # fmt: skip
        since = [x for x in self.samples if x["t_ms"] >= spawn]
        beats = [x["beat_ms"] for x in since if x["beat_ms"] > spawn]
        changes = [x["changed_ms"] for x in since if x["changed_ms"] > spawn]
        c |= {"first_batch": s["batch"], "first_done_ms": s["done_ms"], "back_ms": None,
              "gave_up_ms": None, "supervisor_ms": min(beats, default=None),
              "query_ms": min(changes, default=None)}  # fmt: skip
        log(f"failover: start {c['index'] + 1}: first batch after {_s(spawn, s['done_ms'])} s")
        back = True
        if c["prekill_level"] is not None:
            try:
                s = self.wait_for(lambda s: s["backlog"] <= c["prekill_level"], RECOVER_TIMEOUT_S,
                                  "the backlog to come back to its pre-kill level")  # fmt: skip
                c["back_ms"] = s["t_ms"]
            except WaitTimeout as e:
                log(f"failover: {e}; no further kills")
                self.stopped = (
                    f"start {c['index'] + 1}: backlog not back in {RECOVER_TIMEOUT_S:.0f} s"
                )
                c["gave_up_ms"], back = now_ms(), False
        c["peak_backlog"] = max(x["backlog"] for x in self.samples if x["t_ms"] >= spawn)
        return back

    def _run_then_kill(self, index: int) -> dict[str, Any] | None:
        """Run steadily, SIGKILL, restart; None (no kill) if the backlog never got small."""
        try:
            caught_up = self.rate_per_s * CAUGHT_UP_S
            self.wait_for(lambda s: s["backlog"] <= caught_up, RECOVER_TIMEOUT_S,
                          f"the backlog under {CAUGHT_UP_S:.0f} s of input")  # fmt: skip
        except WaitTimeout as e:
            log(f"failover: {e}; no further kills")
            self.stopped = f"before kill {index}: backlog not under {CAUGHT_UP_S:.0f} s of input"
            return None
        steady_s = self.rng.uniform(*self.steady_s)
        steady_from = now_ms()
        until = steady_from + steady_s * 1000
        self.wait_for(lambda s: s["t_ms"] >= until, steady_s + 30, "the steady run")
        since = max(steady_from, until - PREKILL_WINDOW_S * 1000)
        last, killed_ms = self.samples[-1], now_ms()
        self.proc.kill9()
        log(f"failover: SIGKILL {index} after {steady_s:.1f} s steady ({last}); restarting")
        peak = max(x["backlog"] for x in self.samples if x["t_ms"] >= since)
        at_kill = {"backlog_at_kill": last["backlog"], "last_batch_at_kill": last["batch"]}
        return self._spawn(index, killed_ms=killed_ms, ran_s=steady_s, prekill_level=peak,
                           **at_kill)  # fmt: skip

    def _drain_and_check(self) -> dict[str, Any]:
        produced = self.producer.sent_events
        try:
            self.wait_for(lambda s: s["backlog"] == 0 and s["events_in"] >= produced,
                          2 * RECOVER_TIMEOUT_S, "the final drain")  # fmt: skip
            drained = True
        except WaitTimeout as e:
            log(f"failover: {e}")
            drained = False
        time.sleep(2.0)  # let a last record settle
        final = {k: stat_counter(self.client, k) for k in COUNTERS}
        records = sorted(recent_batches(self.client, 600), key=lambda r: r["batch"])
        flow = sorted((st for st in Board(self.client).timeline(TIMELINE_LEN)
                       if st.get("stage") == SPARK), key=lambda st: st["updated_ms"])  # fmt: skip
        txn_total = count_metric_total(self.client, "txn_count")
        exit_code = self.proc.stop()
        return {
            "produced": produced, "achieved_per_s": self.producer.achieved_per_s(),
            "drained": drained, "final": final, "txn_count_total": txn_total,
            "exit_code": exit_code, "busy_polls": self.busy_polls,
            "errors_logged": self.proc.log_path.read_text(errors="replace").count("level=ERROR"),
            "busy_replies": self.producer.busy_replies, "stopped": self.stopped,
            "cycles": [summary(c, records, flow) for c in self.cycles], "records": records,
            "flow": flow, "samples": [[s["t_ms"], s["backlog"]] for s in self.samples],
        }  # fmt: skip


def summary(c: dict[str, Any], records: list[dict[str, Any]], flow: list[dict[str, Any]]
            ) -> dict[str, Any]:  # fmt: skip
    """One incarnation's row: seconds from the restart, the first recorded batch's record, and
    the catch-up after it (the batches until the backlog was back, and whether the Spark task's
    admission was throttled meanwhile: its lowest rate)."""
    first = next((r for r in records if r["batch"] == c["first_batch"]), None)
    until = c["back_ms"] or c["gave_up_ms"]
    catchup = [r["events"] for r in records if until and c["first_done_ms"] < r["done_ms"] <= until]
    rates = [float(st["rate"]) for st in flow if st.get("backpressure") and until
             and c["spawn_ms"] <= st["updated_ms"] <= until]  # fmt: skip
    keep = ("index", "first_batch", "ran_s", "prekill_level", "backlog_at_kill", "back_ms",
            "last_batch_at_kill", "peak_backlog", "killed_ms", "first_done_ms")  # fmt: skip
    spawn = c["spawn_ms"]
    row = {k: c[k] for k in keep} | {
        "supervisor_s": _s(spawn, c["supervisor_ms"]), "query_s": _s(spawn, c["query_ms"]),
        "first_batch_s": _s(spawn, c["first_done_ms"]), "back_s": _s(c["killed_ms"], c["back_ms"]),
        "gave_up": c["gave_up_ms"] is not None, "throttled_min_rate": min(rates, default=None),
        "catchup": until and {"batches": len(catchup), "median_events": median(catchup)},
        "first_record": first and {"events": first["events"],
                                   "applied": first["updates_applied"],
                                   "own_s": (first["done_ms"] - first["started_ms"]) / 1000,
                                   "duplicates": first["updates_duplicate"]},
    }  # fmt: skip
    return row
