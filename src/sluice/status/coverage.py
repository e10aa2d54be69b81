"""How far back each metric's stored history reaches: what the live fold and backfills wrote.

The live fold writes a metric's slices from the first whole slice after it began folding it
(`sluice:{stats}:folding`, recorded at its first batch); a backfill writes them from its start
(`sluice:{backfill}:starts`, the earliest over the runs, 0 for a run over the whole archive) to
its seam (`sluice:{backfill}:seams`). A window is complete only where these cover it with no
gap. `offline.store` refuses a training row outside them, and `sluice status` and
`/v1/status` show per metric where its complete history begins and how much of its retention
is not covered: a metric added to a running deployment answers from its first batch on, and
its long windows miss what came before until a backfill writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.config import Config
from sluice.redis.keys import FOLDING_KEY, SEAMS_KEY, STARTS_KEY
from sluice.units import format_duration_ms


@dataclass(frozen=True)
class Written:
    """What wrote one metric's slices (times in ms): a backfill up to `seam` (None: none ran)
    from `start`, and the live fold since `began` (None: it has not folded the metric)."""

    seam: int | None = None
    began: int | None = None
    start: int = 0

    def live_from(self, coarsest: int) -> int | None:
        """The live fold's first whole slice of the metric's coarsest length."""
        return None if self.began is None else -(-self.began // coarsest) * coarsest

    def complete_from(self, coarsest: int) -> int | None:
        """Where the history that runs on to now begins, with no gap; None without a live
        fold (a backfill alone ends at its seam)."""
        live = self.live_from(coarsest)
        if live is None:
            return None
        if self.seam is not None and live <= self.seam:
            return min(self.start, live)
        return live


def read_written(client: Any) -> dict[str, Written]:
    """Every metric's `Written`, from the three hashes (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for key in (SEAMS_KEY, FOLDING_KEY, STARTS_KEY):
        pipe.hgetall(key)
    seams, began, starts = ({k.decode(): int(v) for k, v in raw.items()} for raw in pipe.execute())
    return {
        name: Written(seams.get(name), began.get(name), starts.get(name, 0))
        for name in {*seams, *began}
    }


def metric_history(client: Any, cfg: Config, now_ms: int) -> dict[str, dict[str, Any]]:
    """Per stored metric of `cfg`: `complete_from_ms` (null: no live fold yet), `live_from_ms`,
    `backfilled_until_ms` (the newest seam, or null) and `missing_ms`, the part of its
    retention before `complete_from_ms` (the whole retention without a live fold)."""
    written = read_written(client)
    out: dict[str, dict[str, Any]] = {}
    for m in cfg.metrics:
        w = written.get(m.name, Written())
        coarsest = m.slice_lengths()[-1]
        since = w.complete_from(coarsest)
        held_from = now_ms - m.retention
        out[m.name] = {
            "complete_from_ms": since,
            "live_from_ms": w.live_from(coarsest),
            "backfilled_until_ms": w.seam,
            "missing_ms": m.retention if since is None else max(0, min(since, now_ms) - held_from),
            "retention_ms": m.retention,
        }
    return out


def new_metric_notes(client: Any, cfg: Config) -> list[str]:
    """One line per metric of `cfg` that nothing has written yet while another one has been
    folded live: a metric added to a running deployment, whose history starts empty."""
    written = read_written(client)
    if not any(w.began is not None for w in written.values()):
        return []  # a new deployment: every metric starts here, and there is nothing to say
    return [
        f"metric {m.name!r} is new to this store: its answers cover the events folded from now"
        f" on, and windows reaching before that miss what came before (its retention is"
        f" {format_duration_ms(m.retention)}); `sluice backfill --metrics {m.name} --input"
        " <archive>` writes its history"
        for m in cfg.metrics
        if m.name not in written
    ]
