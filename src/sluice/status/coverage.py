"""How far back each metric's stored history reaches: what the live fold and backfills wrote.

The live fold writes a metric's slices from the first whole slice after it began folding it
(`sluice:{stats}:folding`, recorded at its first batch); each backfill writes them from its
start (0 for a run over the whole archive) to its seam, and the spans the runs wrote are kept
merged (`sluice:{backfill}:spans`; the newest seam, which the live fold reads, is in
`sluice:{backfill}:seams`). A window is complete only where these cover it with no gap.
`offline.store` refuses a training row outside them, and `sluice status` and `/v1/status`
show per metric where its complete history begins and how much of its retention is not
covered: a metric added to a running deployment answers from its first batch on, and its long
windows miss what came before until a backfill writes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sluice.config import Config
from sluice.redis.keys import FOLDING_KEY, SEAMS_KEY, SPANS_KEY, STARTS_KEY
from sluice.units import format_duration_ms

Spans = tuple[tuple[int, int], ...]  # [start, end) in ms, sorted, apart from each other
FOREVER = 2**63 - 1  # the live fold's span has no end


def merged(spans: Iterable[tuple[int, int]]) -> Spans:
    """`spans` sorted, with those that meet or overlap joined into one."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def spans_text(spans: Spans) -> str:
    return ",".join(f"{a}:{b}" for a, b in spans)


def parse_spans(text: str | bytes) -> Spans:
    text = text.decode() if isinstance(text, bytes) else text
    return tuple((int(a), int(b)) for a, b in (p.split(":") for p in text.split(",") if p))


@dataclass(frozen=True)
class Written:
    """What wrote one metric's slices (times in ms): backfills, the `spans` [start, seam) of
    their runs merged, `seam` the newest (None: none ran), and the live fold since `began`
    (None: it has not folded the metric)."""

    seam: int | None = None
    began: int | None = None
    spans: Spans = ()

    def live_from(self, coarsest: int) -> int | None:
        """The live fold's first whole slice of the metric's coarsest length."""
        return None if self.began is None else -(-self.began // coarsest) * coarsest

    def covered(self, coarsest: int) -> Spans:
        """Every span something wrote, the live fold's (to `FOREVER`) among them, merged."""
        live = self.live_from(coarsest)
        return merged([*self.spans, *([(live, FOREVER)] if live is not None else [])])

    def gap(self, lo: int, hi: int, coarsest: int) -> tuple[int, int] | None:
        """The first part of [lo, hi) that nothing wrote, or None: all of it was written."""
        at = lo
        for a, b in self.covered(coarsest):
            if at < a:
                return at, min(a, hi)
            at = max(at, b)
            if at >= hi:
                return None
        return (at, hi) if at < hi else None

    def complete_from(self, coarsest: int) -> int | None:
        """Where the history that runs on to now begins, with no gap; None without a live
        fold (a backfill alone ends at its seam)."""
        spans = self.covered(coarsest)
        return spans[-1][0] if self.began is not None else None


def read_written(client: Any) -> dict[str, Written]:
    """Every metric's `Written`, from the four hashes (one round trip). A store whose backfills
    ran before their spans were kept has the earliest start and the newest seam: one span."""
    pipe = client.pipeline(transaction=False)
    for key in (SEAMS_KEY, FOLDING_KEY, STARTS_KEY, SPANS_KEY):
        pipe.hgetall(key)
    seams, began, starts, spans = (
        {k.decode(): v for k, v in raw.items()} for raw in pipe.execute()
    )  # fmt: skip
    return {
        name: Written(
            int(seams[name]) if name in seams else None,
            int(began[name]) if name in began else None,
            stored_spans(spans.get(name), seams.get(name), starts.get(name)),
        )
        for name in {*seams, *began}
    }


def stored_spans(spans: bytes | None, seam: bytes | None, start: bytes | None) -> Spans:
    """A metric's spans as stored (`SPANS_KEY`), or for backfills that ran before spans were
    kept, the one span from their earliest start (`STARTS_KEY`) to their newest seam."""
    if spans is not None:
        return parse_spans(spans)
    return ((int(start or 0), int(seam)),) if seam is not None else ()


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
