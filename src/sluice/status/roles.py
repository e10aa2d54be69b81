"""Which `sluice run` processes there are, and which one leads (see `pipeline.lease`).

Read only, from Redis: the process registry (`sluice:{lease}:processes`, one entry per process,
renewed every second) and each query's lease (`sluice:{lease}:q:<query>`). A process that
stopped beating for STALE_MS (killed, or cut off from Redis) is left out.
"""

from __future__ import annotations

from typing import Any

import orjson

from sluice.config import Config
from sluice.graph import fold_stage, graph_topology
from sluice.redis.keys import PROCESSES_KEY, lease_key

STALE_MS = 5_000


def query_names(cfg: Config) -> list[str]:
    """The streaming queries of `cfg`, as `sluice run` names them (stages, then folds)."""
    graph = graph_topology(cfg)
    return [st.name for st in graph.stages] + [fold_stage(cfg, s) for s in graph.folds]


def read_roles(client: Any, cfg: Config, now_ms: int) -> dict[str, Any]:
    """`{"processes": [...], "leases": {query: ...}, "leader": ... | None}`.

    A process: host, pid, role (`leader`, `standby`), epoch (a leader's term), its queries,
    state_dir, `heartbeat_age_ms`, `up_ms`, `lease_age_ms` (a leader: since it last renewed
    its lease; null for a standby) and `warm` (its warm-up batch ran). A lease: its holder's
    host, pid and epoch, `live`, `lease_age_ms` (since the last renewal), `expires_in_ms` (null
    once released) and `held_ms` (since the term began). `leader` is the process holding the
    source fold's lease (or the first query's) while it is live.
    """
    names = query_names(cfg)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(PROCESSES_KEY)
    for name in names:
        pipe.hgetall(lease_key(name))
    raw_procs, *raw_leases = pipe.execute()
    leases: dict[str, Any] = {}
    for name, raw in zip(names, raw_leases, strict=True):
        if raw:
            leases[name] = _lease({k.decode(): v.decode() for k, v in raw.items()}, now_ms)
    live = {x["owner"]: x for x in leases.values() if x["live"]}
    processes = []
    for owner, value in raw_procs.items():
        rec = orjson.loads(value)
        beat_age = now_ms - int(rec.get("beat_ms", 0))
        if beat_age > STALE_MS:
            continue
        held = live.get(owner.decode())
        role = rec.get("role", "unknown")
        if role == "leader" and held is None:
            role = "leader (lease lapsed)"
        processes.append({
            "host": rec.get("host"), "pid": rec.get("pid"), "role": role,
            "epoch": rec.get("epoch") if held else None, "queries": rec.get("queries", []),
            "state_dir": rec.get("checkpoint"), "heartbeat_age_ms": beat_age,
            "up_ms": now_ms - int(rec.get("started_ms", now_ms)),
            "lease_age_ms": held["lease_age_ms"] if held else None,
            "warm": bool(rec.get("warm")),
        })  # fmt: skip
    processes.sort(key=lambda p: (not str(p["role"]).startswith("leader"), p["host"], p["pid"]))
    first = leases.get("spark") or (leases.get(names[0]) if names else None)
    leader = first if first is not None and first["live"] else None
    return {"processes": processes, "leases": leases, "leader": leader}


def _lease(raw: dict[str, str], now_ms: int) -> dict[str, Any]:
    renewed, expires = int(raw.get("renewed_ms", 0)), int(raw.get("expires_ms", 0))
    return {
        "owner": raw.get("owner", ""),
        "host": raw.get("host"),
        "pid": int(raw.get("pid") or 0),
        "epoch": int(raw.get("epoch") or 0),
        "live": expires > now_ms,
        "lease_age_ms": now_ms - renewed,
        # A released lease (its holder stopped cleanly) has no expiry left: null, not -now.
        "expires_in_ms": expires - now_ms if expires else None,
        "held_ms": now_ms - int(raw.get("acquired_ms", now_ms)),
        "checkpoint": raw.get("checkpoint"),
    }
