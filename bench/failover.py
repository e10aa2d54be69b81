"""Failover: the longest produce->queryable latency across `kill -9`s of `sluice run`, with and
without a hot standby.

    .venv/bin/python bench/failover.py            # 5 kills per mode, about 14 minutes
    .venv/bin/python bench/failover.py --quick    # 2 kills per mode

Per mode, a fresh embedded Redis and state_dir; a paced producer (`--rate`, jsonl) and a probe
every PROBE_EVERY_S: one event with a card of its own, queryable once its slice hash exists
(polled every POLL_S). `restart`: one `sluice run`, killed (its whole process group) and started
again at once, as a supervisor such as systemd would. `standby`: two `sluice run -c same.yaml`;
the leader is killed, the standby takes over, and once the new leader has caught up (a probe sent
after its first batch is queryable) the killed one is started again and stands by (warm) before
the next kill: on a cluster it restarts on its own host, so its cold start does not take the new
leader's cores. `standby-shared`: the same, but the killed one is started again at once, on the
same 2 cores as the new leader. Between kills the pipeline runs steadily for `--steady` seconds.
At the end the backlog drains and `events_in` must equal the events sent. Latencies count from
the first batch (and a warm standby) on; each kill's, until the next kill. Writes
bench/results/failover[.quick].json, with every probe's (sent ms, latency ms) as its series.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson
import redis
import yaml

from lib.load import (
    PacedProducer,
    bench_config_data,
    build_pool,
    now_ms,
    open_writer,
    probe_command,
)
from lib.procs import SluiceProcess, Workspace, stat_counter
from lib.results import Run, log, parser
from lib.stats import median
from sluice.config import config_from_dict
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import STATS_KEY, encode_key, slice_hash_key
from sluice.status.roles import read_roles

PROBE_EVERY_S = 0.1
POLL_S = 0.05
WAIT_S = 240.0
BATCH_CAP = 200_000
MODES = ("restart", "standby", "standby-shared")


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
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def run_mode(mode: str, ws: Workspace, kills: int, rate: float, steady_s: float) -> dict[str, Any]:
    root = ws.state_dir(mode)
    with EmbeddedRedis(root / "redis") as server:
        data = bench_config_data("jsonl", root / "state", BATCH_CAP) | {"redis": server.url}
        cfg_path = root / "sluice.yaml"
        cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
        cfg = config_from_dict(data)
        client = redis.Redis.from_url(server.url)
        pool = build_pool(cfg, 20_000, 1, now_ms())
        n = 0

        def spawn() -> SluiceProcess:
            nonlocal n
            n += 1
            return SluiceProcess(["run", "-c", str(cfg_path)], root / f"run-{n}.log").start()

        def roles() -> dict[str, Any]:
            return read_roles(client, cfg, now_ms())

        def leads(p: SluiceProcess) -> bool:
            leader = roles()["leader"]
            return leader is not None and p.proc is not None and leader["pid"] == p.proc.pid

        def warm(p: SluiceProcess) -> bool:
            assert p.alive(), p.tail()
            pid = p.proc.pid if p.proc else None
            return any(x["pid"] == pid and x["role"] == "standby" and x["warm"]
                       for x in roles()["processes"])  # fmt: skip

        def last_done() -> int:
            raw = client.hget(STATS_KEY, "last_batch")
            return int(orjson.loads(raw)["done_ms"]) if raw else 0

        started = [spawn() for _ in range(1 if mode == "restart" else 2)]
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
                    standby = spawn()
                if standby is not None:
                    wait(lambda s=standby: warm(s), "the restarted process to stand by warm")
                cycles.append(
                    {"killed_ms": killed_ms, "first_batch_s": (first_ms - killed_ms) / 1000}
                )
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
            "mode": mode, "kills": cycles, "steady_from_ms": steady_from_ms,
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
    a = p.parse_args()
    modes_wanted = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes_wanted if m not in MODES]
    if unknown or not modes_wanted:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    a.kills = a.kills or (2 if a.quick else 5)
    run = Run("failover", a)
    ws = Workspace()
    try:
        modes = [run_mode(m, ws, a.kills, a.rate, a.steady) for m in modes_wanted]
    finally:
        ws.cleanup()
    params = {"rate_per_s": a.rate, "kills": a.kills, "steady_s": a.steady,
              "probe_every_ms": PROBE_EVERY_S * 1000, "poll_ms": POLL_S * 1000,
              "batch_cap": BATCH_CAP}  # fmt: skip
    series = {m["mode"]: m.pop("probe_series") for m in modes}  # [sent ms, latency ms] per probe
    run.write(params, {"modes": modes}, series)


if __name__ == "__main__":
    main()
