"""The store's floor under two layouts of slice hashes, before choosing a stored format.

    .venv/bin/python bench/store_layout.py            # 3 rounds, ~2 min
    .venv/bin/python bench/store_layout.py --quick    # 1 round, fewer keys

Today a slice hash holds one metric of one key (`sluice:s:{<metric>|<key>}`). The alternative
measured here holds every metric with the same key fields (a key set) for one key, one field per
(metric, slice start), with each metric's bounds (`_m`) and seam (`_b`) as fields of their own.
The high-cardinality plan has three key sets of two metrics each (docs/benchmarks.md, ingest), so
one script step per key set and key replaces two. A third variant, **per key set, blind**,
writes the same hashes without reading them first, as a layout whose writer sends each slice's
whole value (kept in Spark's state) would, and **per key set, native** sends those writes as
plain pipelined commands, with no script.

Neither layout runs Sluice's merge here: per layout, a Lua script makes the Redis calls that
`write_slices.lua` makes for a slice hash, and nothing else, over `--keys` keys and 2 metrics:
`HMGET` of the bounds, the seam and the slices, one `HSET` of the slices and bounds, and a
`PEXPIREAT` for a new hash. Pass 1 creates every hash (a new key, as most keys are in the
high-cardinality workload's batches); passes 2 to 4 update them (a new slice each, the hash
read first). Calls carry 500 keys (the writer's `KEYS_PER_CALL`), pipelined. Each round starts a
fresh embedded Redis (the default one: AOF on, `appendfsync everysec`) per layout, in
alternating order, and measures Redis's own CPU (from /proc) per slice update, so the two
layouts' numbers are side by side in one run; the ratio is the share of Redis's per-update work
a shared hash would leave, before the merge and the script's own parsing, which both pay alike.
Writes bench/results/store-layout[.quick].json.
"""

from __future__ import annotations

import statistics
from typing import Any

import redis

from lib.procs import Workspace, proc_cpu_s
from lib.results import Run, log, parser
from sluice.redis.embedded import EmbeddedRedis

METRICS = 2  # per key set: the high-cardinality plan's three key sets hold two metrics each
PER_CALL = 500  # keys per EVALSHA, as the writer sends them
PASSES = 4  # pass 1 creates the hashes, the others update them

# KEYS: hashes. ARGV: metrics per hash, slice start, expire-at, 1 when the hashes are new, 1 to
# read them first. Per hash: for each of its metrics, a bounds field, a seam field and a slice
# field read in one HMGET; the slices and bounds written in one HSET; a new hash gets its
# PEXPIREAT.
SCRIPT = """
local m, start, expire_at, new = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4] == '1'
local read_first = ARGV[5] == '1'
for i = 1, #KEYS do
  local key, read, write = KEYS[i], {}, {}
  for j = 1, m do
    read[#read + 1] = '_m' .. j
    read[#read + 1] = '_b' .. j
    read[#read + 1] = j .. '|' .. start
    write[#write + 1] = j .. '|' .. start
    write[#write + 1] = '1700000000000:1'
    write[#write + 1] = '_m' .. j
    write[#write + 1] = start .. ':' .. start
  end
  if read_first then redis.call('HMGET', key, unpack(read)) end
  redis.call('HSET', key, unpack(write))
  if new then redis.call('PEXPIREAT', key, expire_at) end
end
return #KEYS
"""


LAYOUTS = ("metric", "keyset", "keyset_blind", "keyset_native")


def layout_keys(layout: str, keys: int) -> list[tuple[list[str], int]]:
    """(hash keys, metrics per hash) of each call: `metric` keeps a hash per metric and key,
    `keyset` (and `keyset_blind`, which writes without reading, and `keyset_native`, the
    same commands pipelined without a script) one per key holding both metrics."""
    if layout == "metric":
        names = [f"sluice:s:{{m{j}|c{i}}}" for i in range(keys) for j in range(METRICS)]
        per = 1
    else:
        names = [f"sluice:g:{{card|c{i}}}" for i in range(keys)]
        per = METRICS
    return [(names[i : i + PER_CALL], per) for i in range(0, len(names), PER_CALL)]


def native(pipe: Any, names: list[str], per: int, start: str, new: bool) -> None:
    """What SCRIPT does without its read, as plain commands: one HSET per hash, and a
    PEXPIREAT for a new one."""
    for key in names:
        fields: dict[str, str] = {}
        for j in range(1, per + 1):
            fields[f"{j}|{start}"] = "1700000000000:1"
            fields[f"_m{j}"] = f"{start}:{start}"
        pipe.hset(key, mapping=fields)
        if new:
            pipe.pexpireat(key, 1_900_000_000_000)


def measure(ws: Workspace, layout: str, keys: int, rnd: int) -> dict[str, Any]:
    """Redis CPU µs per slice update of one layout, for the pass that creates the hashes and
    for the passes that update them, into a fresh embedded Redis."""
    srv = EmbeddedRedis(ws.state_dir(f"redis-{layout}-{rnd}")).start()
    try:
        c = redis.Redis.from_url(srv.url)
        sha = c.script_load(SCRIPT)
        calls = layout_keys(layout, keys)
        blind = layout.endswith(("_blind", "_native"))
        out: dict[str, Any] = {"hashes": sum(len(k) for k, _ in calls)}
        spent = []
        for p in range(PASSES):
            start = str(1_700_000_000_000 + p * 10_000)
            cpu0 = proc_cpu_s(srv.pid)
            for i in range(0, len(calls), 20):
                pipe = c.pipeline(transaction=False)
                for names, per in calls[i : i + 20]:
                    if layout.endswith("_native"):
                        native(pipe, names, per, start, new=p == 0)
                        continue
                    pipe.evalsha(sha, len(names), *names, per, start, "1900000000000",
                                 "1" if p == 0 else "0", "0" if blind else "1")  # fmt: skip
                pipe.execute()
            spent.append(proc_cpu_s(srv.pid) - cpu0)
        updates = keys * METRICS  # slice updates per pass, either layout
        out["new_us"] = spent[0] * 1e6 / updates
        out["update_us"] = statistics.median(spent[1:]) * 1e6 / updates
        out["memory"] = c.info("memory")["used_memory"]
        c.close()
    finally:
        srv.stop()
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    p.add_argument("--keys", type=int, help="keys per key set (default 100,000; quick 20,000)")
    a = p.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.keys = a.keys or (20_000 if a.quick else 100_000)
    run = Run("store-layout", a)
    ws = Workspace()
    rounds = []
    try:
        for rnd in range(a.rounds):
            order = LAYOUTS if rnd % 2 == 0 else LAYOUTS[::-1]
            got = {layout: measure(ws, layout, a.keys, rnd) for layout in order}
            log(f"round {rnd}: " + "; ".join(
                f"{k}: new {v['new_us']:.2f} µs, update {v['update_us']:.2f} µs per slice update"
                for k, v in got.items()))  # fmt: skip
            rounds.append(got)
    finally:
        ws.cleanup()

    def med(layout: str, key: str) -> float:
        return statistics.median(r[layout][key] for r in rounds)

    results = {
        layout: {k: med(layout, k) for k in ("new_us", "update_us", "memory")}
        | {"hashes": rounds[0][layout]["hashes"]}
        for layout in LAYOUTS
    }
    for layout in LAYOUTS[1:]:
        for phase in ("new_us", "update_us"):
            results[layout][f"ratio_{phase}"] = statistics.median(
                r[layout][phase] / r["metric"][phase] for r in rounds
            )
    results["rounds"] = rounds
    run.write({"keys": a.keys, "metrics": METRICS, "per_call": PER_CALL, "passes": PASSES,
               "rounds": a.rounds}, results)  # fmt: skip


if __name__ == "__main__":
    main()
