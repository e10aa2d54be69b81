"""Failover: the longest produce->queryable latency across `kill -9`s of `sluice run`, with and
without a hot standby.

    .venv/bin/python bench/failover.py            # 5 kills per mode, about 14 minutes
    .venv/bin/python bench/failover.py --quick    # 2 kills per mode
    .venv/bin/python bench/failover.py --plan six --modes standby   # the six-metric plan

Plans (`--plan`): `bench`, the benchmarks' 3 metrics on Zipf keys in jsonl; `six`, six metrics
over three key sets (card; merchant; card + merchant) with 10 s, 30 s and 1 m slices (count,
sum, min, max, avg, a filtered count) on Zipf keys in `fields`; `highcard`, the ingest
benchmark's high-cardinality workload (its six metrics, 100,000 cards, events spread over 10
minutes) in `fields`. For each kill the new leader's first batches are recorded with their
phases (`sluice:{stats}:timings`), and when it took the lease (its log), so that a slow
takeover shows where its seconds went.

Per mode, a fresh embedded Redis and state_dir; a paced producer (`--rate`, jsonl) and a probe
every PROBE_EVERY_S: one event with a card of its own, queryable once its slice hash exists
(polled every POLL_S). `restart`: one `sluice run`, killed (its whole process group) and started
again at once, as a supervisor such as systemd would. `standby`: two `sluice run -c same.yaml`;
the leader is killed, the standby takes over, and once the new leader has caught up (a probe sent
after its first batch is queryable) the killed one is started again and stands by (warm) before
the next kill: on a cluster it restarts on its own host, so its cold start does not take the new
leader's cores. `standby-shared`: the same, but the killed one is started again at once, on the
same 2 cores as the new leader. `standby-warming`: one `sluice run` leads; before each kill a
second one is started, and the leader is killed WARMING_KILL_S after the new one stands by, in
the middle of its first warm-up (10-30 s here), which it must not wait for. Between kills the
pipeline runs steadily for `--steady` seconds.
At the end the backlog drains and `events_in` must equal the events sent. Latencies count from
the first batch (and a warm standby) on; each kill's, until the next kill. Writes
bench/results/failover[.quick].json, with every probe's (sent ms, latency ms) as its series.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from lib.load import (
    HIGHCARD_METRICS,
    PacedProducer,
    bench_config_data,
    build_pool,
    now_ms,
    open_writer,
    probe_command,
)
from lib.procs import SluiceProcess, Workspace, stat_counter, wait_until
from lib.results import Run, log, parser
from lib.stats import median
from sluice.config import config_from_dict
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import STATS_KEY, encode_key, slice_hash_key
from sluice.status.roles import read_roles
from sluice.status.timings import read_timings

PROBE_EVERY_S = 0.1
POLL_S = 0.05
WAIT_S = 240.0
BATCH_CAP = 200_000
MODES = ("restart", "standby", "standby-shared", "standby-warming")
WARMING_KILL_S = 2.0  # standby-warming: the kill, this long after the new process stands by
WARM_LINE = re.compile(rb'^ts=(\S+) level=INFO logger=\S+ msg="standby warm"')
SIX_METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1h"},
    {"name": "card_amount", "key": ["card"], "agg": "sum", "value": "amount", "slice": "10s",
     "retention": "1h"},
    {"name": "merchant_max", "key": ["merchant"], "agg": "max", "value": "amount",
     "slice": "30s", "retention": "1h"},
    {"name": "merchant_min", "key": ["merchant"], "agg": "min", "value": "amount",
     "slice": "30s", "retention": "1h"},
    {"name": "pair_avg", "key": ["card", "merchant"], "agg": "avg", "value": "amount",
     "slice": "1m", "retention": "1h"},
    {"name": "pair_big", "key": ["card", "merchant"], "agg": "count", "filter": "amount > 100",
     "slice": "1m", "retention": "1h"},
]  # fmt: skip
# plan -> (metrics, format, workload)
PLANS: dict[str, tuple[list[dict[str, Any]] | None, str, str]] = {
    "bench": (None, "jsonl", "zipf"),
    "six": (SIX_METRICS, "fields", "zipf"),
    "highcard": (HIGHCARD_METRICS, "fields", "highcard"),
}
LEADER_LINE = re.compile(rb'^ts=(\S+) level=INFO logger=\S+ msg="pipeline role" role=leader')
FIRST_BATCH_LINE = re.compile(
    rb'^ts=(\S+) level=INFO logger=\S+ msg="first batch" .*since_start_ms=(\d+)'
)


class Probes(threading.Thread):
    """Sends a probe event every PROBE_EVERY_S and notes when each became queryable."""

    def __init__(self, url: str, cfg: Any) -> None:
        super().__init__(name="bench-probes", daemon=True)
        self.client = redis.Redis.from_url(url)
        self.sender = open_writer(url)
        self.cfg = cfg
        self.sent: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.stop_evt = threading.Event()

    def run(self) -> None:
        i, next_probe = 0, time.monotonic()
        while not self.stop_evt.is_set() or len(self.seen) < len(self.sent):
            if not self.stop_evt.is_set() and time.monotonic() >= next_probe:
                card, at = f"probe-{i}", now_ms()
                self.sender.call_many([probe_command(self.cfg, card, at)])
                self.sent[card] = at
                i, next_probe = i + 1, next_probe + PROBE_EVERY_S
            waiting = [c for c in self.sent if c not in self.seen]
            if waiting:
                pipe = self.client.pipeline(transaction=False)
                for c in waiting:
                    pipe.exists(slice_hash_key("txn_count", encode_key([c])))
                t = now_ms()
                for c, found in zip(waiting, pipe.execute(), strict=True):
                    if found:
                        self.seen[c] = t
            time.sleep(POLL_S)

    def seen_since(self, at_ms: int) -> bool:
        """Whether a probe sent at or after `at_ms` is queryable."""
        return any(self.sent[c] >= at_ms for c in list(self.seen))

    def latencies(self, lo_ms: int = 0, hi_ms: int = 2**62) -> list[int]:
        """Produce->queryable of the probes sent in [lo_ms, hi_ms)."""
        return [
            self.seen[c] - t for c, t in self.sent.items() if lo_ms <= t < hi_ms and c in self.seen
        ]


def wait(ok: Any, what: str, timeout_s: float = WAIT_S) -> None:
    wait_until(ok, what, timeout_s, POLL_S)


def _ts_ms(raw: bytes) -> int:
    return int(dt.datetime.fromisoformat(raw.decode().replace("Z", "+00:00")).timestamp() * 1000)


def takeover_log(log_path: Path, after_ms: int) -> dict[str, Any]:
    """From the new leader's log: when it took the lease and when its query started (both in
    s after `after_ms`), and how long that start took to its first batch."""
    out: dict[str, Any] = {}
    for line in log_path.read_bytes().splitlines():
        if (m := LEADER_LINE.match(line)) and _ts_ms(m.group(1)) >= after_ms:
            out["lease_taken_s"] = (_ts_ms(m.group(1)) - after_ms) / 1000
        if (m := FIRST_BATCH_LINE.match(line)) and _ts_ms(m.group(1)) >= after_ms:
            at, took = _ts_ms(m.group(1)), int(m.group(2))
            out["query_started_s"] = (at - took - after_ms) / 1000
            out["start_to_first_batch_ms"] = took
        if (m := WARM_LINE.match(line)) and "warm_up_done_s" not in out:  # its first warm-up
            out["warm_up_done_s"] = (_ts_ms(m.group(1)) - after_ms) / 1000
    return out


def first_batches(client: Any, after_ms: int, n: int = 4) -> list[dict[str, Any]]:
    """The first `n` batches done after `after_ms`, with when they started (relative to it)."""
    out = []
    for e in read_timings(client, n=200):
        if e["done_ms"] > after_ms and len(out) < n:
            started = e["done_ms"] - e["total_ms"]
            phases = {k: round(v) for k, v in e["phases"].items() if v >= 50}
            out.append({"batch": e["batch"], "events": e["events"],
                        "started_s": round((started - after_ms) / 1000, 2),
                        "took_ms": round(e["total_ms"]), "phases_ms": phases})  # fmt: skip
    return out


def run_mode(
    mode: str,
    ws: Workspace,
    kills: int,
    rate: float,
    steady_s: float,
    plan: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    root = ws.state_dir(f"{plan}-{mode}")
    metrics, fmt, workload = PLANS[plan]
    with EmbeddedRedis(root / "redis") as server:
        data = bench_config_data(fmt, root / "state", BATCH_CAP) | {"redis": server.url}
        if metrics is not None:
            data["metrics"] = metrics
        cfg_path = root / "sluice.yaml"
        cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
        cfg = config_from_dict(data)
        client = redis.Redis.from_url(server.url)
        pool = build_pool(cfg, 20_000 if workload == "zipf" else 200_000, 1, now_ms(), workload)
        n = 0

        def spawn() -> SluiceProcess:
            nonlocal n
            n += 1
            return SluiceProcess(["run", "-c", str(cfg_path)], root / f"run-{n}.log", env).start()

        def roles() -> dict[str, Any]:
            return read_roles(client, cfg, now_ms())

        def leads(p: SluiceProcess) -> bool:
            leader = roles()["leader"]
            return leader is not None and p.proc is not None and leader["pid"] == p.proc.pid

        def warm(p: SluiceProcess, warmed: bool = True) -> bool:
            """`p` stands by (with `warmed`, and its first warm-up ran)."""
            assert p.alive(), p.tail()
            pid = p.proc.pid if p.proc else None
            return any(x["pid"] == pid and x["role"] == "standby" and (x["warm"] or not warmed)
                       for x in roles()["processes"])  # fmt: skip

        def last_done() -> int:
            raw = client.hget(STATS_KEY, "last_batch")
            return int(orjson.loads(raw)["done_ms"]) if raw else 0

        warming = mode == "standby-warming"
        started = [spawn() for _ in range(1 if mode in ("restart", "standby-warming") else 2)]
        producer = PacedProducer(server.url, pool, rate, retry_busy=True)
        probes = Probes(server.url, cfg)
        producer.start()
        probes.start()
        wait(lambda: any(leads(p) for p in started) and last_done() > 0, "the first batch")
        leader = next(p for p in started if leads(p))  # whichever took the lease first
        standby = next((p for p in started if p is not leader), None)
        if standby is not None:
            wait(lambda: warm(standby), "a warm standby")
        cycles: list[dict[str, Any]] = []
        steady_from_ms = now_ms()
        try:
            for k in range(kills):
                time.sleep(steady_s)  # the steady run between kills
                if warming:  # a new standby, killed for in the middle of its first warm-up
                    standby = spawn()
                    wait(lambda s=standby: warm(s, warmed=False), "the new process to stand by")
                    time.sleep(WARMING_KILL_S)
                    warm_at_kill = warm(standby)
                killed_ms = now_ms()
                leader.kill9()
                log(f"{mode}: kill {k + 1} of {kills}")
                if standby is None:
                    leader = spawn()
                else:
                    leader, standby = standby, (spawn() if mode == "standby-shared" else None)
                wait(lambda p=leader, t=killed_ms: leads(p) and last_done() > t,
                     "the new leader's batch")  # fmt: skip
                first_ms = last_done()
                if mode == "standby":
                    wait(lambda t=first_ms: probes.seen_since(t), "the new leader to catch up")
                    time.sleep(2.0)  # the batches after the first, for the breakdown below
                    standby = spawn()
                cycle = {"killed_ms": killed_ms, "first_batch_s": (first_ms - killed_ms) / 1000,
                         "batches": first_batches(client, killed_ms)}  # fmt: skip
                if warming:
                    wait(lambda t=first_ms: probes.seen_since(t), "the new leader to catch up")
                    cycle["standby_warm_at_kill"] = warm_at_kill
                cycle |= takeover_log(leader.log_path, killed_ms)
                log(f"{mode}: {cycle}")
                if standby is not None:
                    wait(lambda s=standby: warm(s), "the restarted process to stand by warm")
                cycles.append(cycle)
            time.sleep(steady_s)
        finally:
            stopped_ms = now_ms()
            producer.stop()
            producer.join(30)
            probes.stop_evt.set()
        probes.join(WAIT_S)
        sent = producer.sent_events + len(probes.sent)
        wait(lambda: stat_counter(client, "events_in") >= sent, "the final drain")
        time.sleep(1.0)
        events_in = stat_counter(client, "events_in")
        for p in (leader, standby):
            if p is not None:
                p.stop()
        # Each kill's window: from 5 s before it to the next kill (or the end of the load).
        ends = [c["killed_ms"] for c in cycles[1:]] + [stopped_ms]
        for c, end in zip(cycles, ends, strict=True):
            gap = probes.latencies(c["killed_ms"] - 5_000, end)
            c["worst_latency_ms"] = max(gap, default=None)
        every = probes.latencies(steady_from_ms, stopped_ms)  # after the first start's warm-up
        series = sorted([t, probes.seen[c] - t] for c, t in probes.sent.items() if c in probes.seen)
        return {
            "plan": plan, "mode": mode, "kills": cycles, "steady_from_ms": steady_from_ms,
            "probe_series": series, "events_sent": sent, "events_in": events_in,
            "exact": events_in == sent, "probes": len(probes.sent),
            "worst_latency_ms": max(every, default=None),
            "median_latency_ms": median(every),
            "first_batch_s_median": median([c["first_batch_s"] for c in cycles]),
            "first_batch_s_max": max((c["first_batch_s"] for c in cycles), default=None),
            "achieved_per_s": producer.achieved_per_s(),
        }  # fmt: skip


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rate", type=float, default=2_000.0, help="producer events/s")
    p.add_argument("--kills", type=int, help="kills per mode: 5, quick 2")
    p.add_argument("--steady", type=float, default=10.0, help="seconds between kills")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--plan", default="bench", choices=sorted(PLANS), help="see above")
    p.add_argument("--sluice-src", type=Path, help="run `sluice run` from this src/ directory"
                   " (an older revision's: git worktree add), not the working tree's")  # fmt: skip
    a = p.parse_args()
    modes_wanted = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes_wanted if m not in MODES]
    if unknown or not modes_wanted:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    a.kills = a.kills or (2 if a.quick else 5)
    name = "failover" if a.plan == "bench" else f"failover-{a.plan}"
    if modes_wanted == ["standby-warming"]:
        name = f"failover-warming{'-' + a.plan if a.plan != 'bench' else ''}"
    run = Run(name, a)
    env = None
    if a.sluice_src is not None:
        env = {"PYTHONPATH": str(a.sluice_src.resolve())}
        log(f"sluice from {env['PYTHONPATH']}")
    ws = Workspace()
    try:
        modes = [run_mode(m, ws, a.kills, a.rate, a.steady, a.plan, env) for m in modes_wanted]
    finally:
        ws.cleanup()
    params = {"plan": a.plan, "rate_per_s": a.rate, "kills": a.kills, "steady_s": a.steady,
              "probe_every_ms": PROBE_EVERY_S * 1000, "poll_ms": POLL_S * 1000,
              "batch_cap": BATCH_CAP, "warming_kill_s": WARMING_KILL_S,
              "sluice_src": str(a.sluice_src) if a.sluice_src else None}  # fmt: skip
    series = {m["mode"]: m.pop("probe_series") for m in modes}  # [sent ms, latency ms] per probe
    run.write(params, {"modes": modes}, series)


if __name__ == "__main__":
    main()
