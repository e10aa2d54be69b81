"""`sluice consistency`: the answers the server gave, recomputed from the archive.

The server logs a sample of its answers (`server.log_answers`, chosen by a hash of the key, so
the same keys are always in it) to `sluice:{consistency}:answers`. Each logged answer names
its metric, key, window, end, value and the interval it covered. For each one, this module
folds the archived events of that interval with the live fold's plan, into the very cells the
store holds (the same window cover, `slices.window.cover`, so the same resolutions and slices),
merges their states with `Agg.merge` in the order the query server reads them and answers with
`Agg.finalize`. So the two sides share every step but where the events came from.

Each answer is then:

    matched      the same value (exactly; sums and averages of doubles to 1e-9 relative, the
                 README's stated exactness for IEEE sums in another order; quantiles over
                 compacted sketches within their rank error, `_quantiles_agree`)
    mismatched   another value: the store does not hold what the archive says
    missing      the metric is no longer configured or folds a stage's output, the archive
                 holds nothing of the interval the answer covered, or it differs and the
                 archive begins or ends inside that interval (it may lack the events before
                 its first or after its last)
    skipped      the answer's last slice was still filling when it was served (its covered end
                 is less than `settle_ms` before the answer): events folded after it would
                 show as differences that are not errors

With `arrival` (the archive's arrival-time column), only events that had arrived by the time
the answer was served count, so events that came late, after the answer, are not held
against it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice import formula
from sluice.config import Config
from sluice.offline.answers import cell_states
from sluice.offline.events import TimeBounds, archive_events, event_time
from sluice.offline.fold import folds_source, offline_config, plan_specs, select_metrics
from sluice.pipeline.plan import explode_updates
from sluice.pipeline.spark import expression_semantics
from sluice.query.engine import integral_value
from sluice.redis.keys import ANSWERS_KEY, CONSISTENCY_KEY, encode_key
from sluice.slices.aggs import AGGS, BLOB, HLL
from sluice.slices.window import cover

SETTLE_MS = 2_000
EXAMPLES = 20
INEXACT = ("avg", "stddev", "variance")  # and sums of doubles: see `_same`
KLL_K = 200  # Spark's kll_sketch_agg_double: a slice's sketch keeps every value up to this many


@dataclass
class Sample:
    """One logged answer."""

    id: str
    metric: str
    key: list[str]
    window_ms: int
    end_ms: int
    value: Any
    covered_start: int
    covered_end: int
    served_ms: int

    @classmethod
    def from_entry(cls, entry_id: bytes, f: dict[bytes, bytes]) -> Sample:
        return cls(
            id=entry_id.decode(),
            metric=f[b"metric"].decode(),
            key=[str(k) for k in orjson.loads(f[b"key"])],
            window_ms=int(f[b"window_ms"]),
            end_ms=int(f[b"end_ms"]),
            value=orjson.loads(f[b"value"]),
            covered_start=int(f[b"covered_start"]),
            covered_end=int(f[b"covered_end"]),
            served_ms=int(f[b"served_ms"]),
        )


def read_samples(client: Any, count: int) -> list[Sample]:
    """The newest `count` logged answers, oldest first."""
    entries = client.xrevrange(ANSWERS_KEY, count=count)
    return [Sample.from_entry(i, f) for i, f in reversed(entries)]


@dataclass
class Report:
    at_ms: int
    input: str
    samples: int = 0
    matched: int = 0
    mismatched: int = 0
    missing: int = 0
    skipped: int = 0
    metrics: dict[str, dict[str, int]] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def count(self, metric: str, result: str) -> None:
        setattr(self, result, getattr(self, result) + 1)
        per = self.metrics.setdefault(
            metric, {"matched": 0, "mismatched": 0, "missing": 0, "skipped": 0}
        )
        per[result] += 1

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _same(online: Any, offline: Any, inexact: bool) -> bool:
    if isinstance(online, dict) or isinstance(offline, dict):
        return dict(online or {}) == dict(offline or {})
    if online is None or offline is None:
        return online is None and offline is None
    if inexact or isinstance(online, float) or isinstance(offline, float):
        return abs(float(online) - float(offline)) <= 1e-9 * max(1.0, abs(float(online)))
    return bool(online == offline)


@expression_semantics
def recompute(
    spark: SparkSession, cfg: Config, events: DataFrame, samples: Sequence[Sample],
    arrival: str | None = None, kept: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per sample id, per base metric it reads: the value the archive gives for the sample's
    own cover (module docstring). `kept`, if given, gets the merged sketch sample of each
    quantile answer (`_quantiles_agree`)."""
    names = sorted({n for s in samples for n in cfg.stored_inputs(s.metric)})
    chosen = select_metrics(cfg, names)
    cfg_off = offline_config(cfg, chosen)
    specs = plan_specs(spark, cfg_off)
    exploded = explode_updates(
        archive_events(events, cfg_off, TimeBounds(), arrival), cfg_off, specs
    )
    pieces: list[tuple[str, str, int, str, int, int, int, int, int]] = []
    for s in samples:
        for name in cfg.stored_inputs(s.metric):
            m = cfg.metric(name)
            assert m is not None
            for order, pc in enumerate(cover(s.end_ms, s.window_ms, m.slice_lengths()).pieces):
                group = next(sp.group for sp in specs if sp.name == name and (
                    sp.slice_ms == pc.slice_ms))  # fmt: skip
                pieces.append((s.id, name, group, encode_key(s.key), pc.slice_ms, pc.first,
                               pc.last + pc.slice_ms, s.served_ms, order))  # fmt: skip
    if not pieces:
        return {}
    ddl = "sid string, name string, g int, k string, r long, lo long, hi long, served long, o int"
    p = spark.createDataFrame(pieces, ddl).alias("p")
    e = exploded.alias("e")
    cond = (
        (F.col("e.g") == F.col("p.g")) & (F.col("e.k") == F.col("p.k"))
        & (F.col("e.t") >= F.col("p.lo")) & (F.col("e.t") < F.col("p.hi"))
    )  # fmt: skip
    if arrival:
        cond = cond & (F.col("e.ems") <= F.col("p.served"))
    # One job for every metric: each metric's fold columns, over its own value where the piece
    # is of that metric (null elsewhere, which every fold skips).
    values: list[Any] = []
    for m in chosen:
        own_specs = [sp for sp in specs if sp.name == m.name]
        v = F.coalesce(*[F.when(F.col("e.g") == sp.group, F.col(f"e.{sp.column('v')}"))
                         for sp in own_specs])  # fmt: skip
        values.append(F.when(F.col("p.name") == m.name, v).alias(f"v{len(values)}"))
    joined = p.join(e, cond).select(
        F.col("p.sid").alias("sid"), F.col("p.name").alias("name"), F.col("p.o").alias("o"),
        (F.col("e.t") - F.pmod(F.col("e.t"), F.col("p.r"))).alias("cell"),
        F.col("e.t").alias("t"), *values,
    )  # fmt: skip
    folds: list[Any] = []
    for i, m in enumerate(chosen):
        agg, v = AGGS[m.agg], F.col(f"v{i}")
        folds.append(F.count(v).alias(f"m{i}_n"))
        folds += [b.alias(f"m{i}_{c}") for c, b in agg.fold_columns(v, F.col("t"))]
    cells = joined.groupBy("sid", "name", "o", "cell").agg(*folds)
    rows = cells.groupBy("sid", "name").agg(
        F.sort_array(F.collect_list(F.struct("o", "cell", *[f"`{c}`" for c in cells.columns[4:]])))
        .alias("cells")
    ).collect()  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    index = {m.name: i for i, m in enumerate(chosen)}
    for row in rows:
        i = index[row["name"]]
        m = chosen[i]
        agg = AGGS[m.agg]
        got = [c.asDict(recursive=True) for c in row["cells"]]
        cells_ = [{k[len(f"m{i}_"):]: v for k, v in c.items() if k.startswith(f"m{i}_")}
                  for c in got]  # fmt: skip
        if agg.state == BLOB and kept is not None:  # the sample, kept for `_quantiles_agree`
            merged = agg.merge(cell_states(agg, cells_))
            kept.setdefault(row["sid"], {})[m.name] = merged
            value = agg.finalize(merged, m, integral_value(cfg, m))
        else:
            value = _answer(agg, m, integral_value(cfg, m), cells_)
        out.setdefault(row["sid"], {})[m.name] = value
    for sample in samples:  # no event in the cover: the empty answer
        for name in cfg.stored_inputs(sample.metric):
            if name not in out.get(sample.id, {}):
                m = chosen[index[name]]
                out.setdefault(sample.id, {})[name] = _answer(
                    AGGS[m.agg], m, integral_value(cfg, m), []
                )
    return out


def _answer(agg: Any, m: Any, integral: bool, cells: list[dict[str, Any]]) -> Any:
    """The cells' states merged and answered as the query server does."""
    if agg.state == HLL:
        from sluice.slices.hll import estimate

        return agg.finalize(estimate({x for c in cells for x in (c["set"] or [])}), m, integral)
    return agg.finalize(agg.merge(cell_states(agg, cells)), m, integral)


def _quantiles_agree(online: Any, merged: Any, m: Any) -> bool:
    """Whether quantiles answered online are within the sketches' rank error of the archive's
    sample (`aggs._kll_sample`: items, cumulative weights), where that sample was compacted (a
    slice of more than KLL's k values): each side then compacted with random choices of its
    own (online, each batch's sketch merged into the stored one), so the two differ within
    that error. Without compaction both hold every value and must be equal."""
    if merged is None or online is None:
        return False
    import numpy as np
    from datasketches import kll_doubles_sketch

    items, cum = merged
    total = float(cum[-1])
    if total <= len(items):  # every value kept, with weight 1: no room for a difference
        return False
    # Each side's error is within the sketch's (99 % bound) on its own; three times it bounds
    # their difference but for a few in a million.
    error = 3 * kll_doubles_sketch.get_normalized_rank_error(KLL_K, False)
    values = online if isinstance(online, dict) else {str(m.quantiles()[0]): online}
    for q in m.quantiles():
        v = values.get(str(q))
        if v is None:
            return False
        below = np.searchsorted(items, v, side="left")
        upto = np.searchsorted(items, v, side="right")
        lo = (float(cum[below - 1]) if below else 0.0) / total
        hi = (float(cum[upto - 1]) if upto else 0.0) / total
        if not lo - error <= q <= hi + error:
            return False
    return True


def _recomputable(cfg: Config, name: str) -> bool:
    """Whether an archive of source events gives the metric `name` (a derived one: all of its
    inputs): not where it folds a stage's output stream."""
    bases = [cfg.metric(n) for n in cfg.stored_inputs(name)]
    return all(b is not None and folds_source(cfg, b) for b in bases)


def nothing_logged(client: Any, input_name: str) -> Report | None:
    """The empty report, stored as `check` stores its reports, when the store holds no logged
    answer at all: then there is nothing to recompute, and no Spark need start to say so."""
    if client.xlen(ANSWERS_KEY):
        return None
    report = Report(at_ms=int(time.time() * 1000), input=input_name)
    client.set(CONSISTENCY_KEY, orjson.dumps(report.as_dict()))
    return report


def check(
    spark: SparkSession, cfg: Config, client: Any, events: DataFrame, input_name: str,
    sample: int = 1000, arrival: str | None = None, settle_ms: int = SETTLE_MS,
) -> Report:  # fmt: skip
    """Compare the newest `sample` logged answers with the archive; store the report at
    CONSISTENCY_KEY (status shows it) and return it."""
    report = Report(at_ms=int(time.time() * 1000), input=input_name)
    samples = read_samples(client, sample)
    report.samples = len(samples)
    names = [m.name for m in cfg.metrics] + [d.name for d in cfg.derived]
    known = {n for n in names if _recomputable(cfg, n)}
    ts = event_time(events, cfg)
    got = None if ts is None else events.select(F.min(ts), F.max(ts)).first()
    first_ms, last_ms = (None, None) if got is None or got[0] is None else map(int, got)
    due: list[Sample] = []
    for s in samples:
        if s.metric not in known:
            report.count(s.metric, "missing")
        elif s.covered_end > s.served_ms - settle_ms:
            report.count(s.metric, "skipped")
        elif first_ms is None or first_ms >= s.covered_end:
            report.count(s.metric, "missing")
        else:
            due.append(s)
    kept: dict[str, dict[str, Any]] = {}
    values = recompute(spark, cfg, events, due, arrival, kept) if due else {}
    for s in due:
        parts = values.get(s.id, {})
        d = cfg.derived_metric(s.metric)
        if d is None:
            offline = parts.get(s.metric)
            inexact = AGGS[cfg.metric(s.metric).agg].name in INEXACT  # type: ignore[union-attr]
        else:
            offline = formula.evaluate(formula.parse(d.expr), parts)
            inexact = True
        if _same(s.value, offline, inexact) or (
            d is None
            and _quantiles_agree(s.value, kept.get(s.id, {}).get(s.metric), cfg.metric(s.metric))
        ):
            report.count(s.metric, "matched")
        elif first_ms is not None and first_ms > s.covered_start:
            report.count(s.metric, "missing")  # the archive may begin after events it lacks
        elif last_ms is not None and last_ms < s.covered_end - 1:
            report.count(s.metric, "missing")  # ... or end before them
        else:
            report.count(s.metric, "mismatched")
            if len(report.examples) < EXAMPLES:
                report.examples.append({"metric": s.metric, "key": s.key,
                                        "window_ms": s.window_ms, "end_ms": s.end_ms,
                                        "online": s.value, "offline": offline})  # fmt: skip
    client.set(CONSISTENCY_KEY, orjson.dumps(report.as_dict()))
    return report
