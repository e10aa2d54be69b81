"""The live fold's plan, for offline input: one definition path.

An offline job folds the metrics it is asked for with `plan.explode_updates` and
`plan.fold_updates`, exactly as a micro-batch is folded, on a copy of the config that holds
only those metrics (their groups, slots and value types as the plan assigns them) and no audit
(the audit follows the log's ids; an archive has none).
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession

from sluice.config import Config, MetricConfig
from sluice.errors import ConfigError
from sluice.pipeline.plan import (
    MetricSpec,
    check_expressions,
    explode_updates,
    fold_columns,
    fold_updates,
    metric_specs,
)


def folds_source(cfg: Config, m: MetricConfig) -> bool:
    """Whether `m` folds the source's events (not a stage's output stream): what an archive of
    events of `source.schema` can be folded into."""
    return m.from_ in (None, cfg.source.stream)


def select_metrics(cfg: Config, names: Sequence[str] | None) -> list[MetricConfig]:
    """The metrics named (for None, all that fold the source's events), in the config's order.
    Raises ConfigError for a name the config does not define, and for a named metric that folds
    a stage's output stream (an archive holds events of the source's schema); a named metric's
    error has no config path, since the mistake is in the names (a CLI's `--metrics`)."""
    known = {m.name: m for m in cfg.metrics}
    derived = {d.name for d in cfg.derived}
    for name in names or ():
        if name not in known:
            what = "a derived metric (name its inputs instead)" if name in derived else "unknown"
            raise ConfigError(
                f"metric {name!r} is {what}; the config's metrics are {', '.join(known)}"
            )
    if names is None:
        chosen = [m for m in cfg.metrics if folds_source(cfg, m)]
        if not chosen:
            raise ConfigError("no metric folds the source's events: each folds a stage's"
                              " output, which an archive of source events does not hold",
                              "metrics")  # fmt: skip
        return chosen
    chosen = [m for m in cfg.metrics if m.name in names]
    for m in chosen:
        if not folds_source(cfg, m):
            raise ConfigError(
                f"metric {m.name!r} folds the stage output {m.from_!r}; offline input holds"
                f" events of source.schema, so fold it from its own archive"
            )
    return chosen


def offline_config(
    cfg: Config, metrics: Sequence[MetricConfig], finest_only: bool = False
) -> Config:
    """`cfg` with only `metrics` and the audit off; `finest_only` drops coarser resolutions (a
    training set reads each metric's finest slices: the value does not depend on the cover)."""
    kept = [m.model_copy(update={"resolutions": None}) if finest_only else m for m in metrics]
    audit = cfg.audit.model_copy(update={"enabled": False})
    return cfg.model_copy(update={"metrics": kept, "derived": [], "audit": audit})


def plan_specs(spark: SparkSession, cfg_off: Config) -> list[MetricSpec]:
    """The plan's specs for `cfg_off` (from `offline_config`), with each value checked against
    the schema as the pipeline checks it at start."""
    return metric_specs(cfg_off, check_expressions(spark, cfg_off))


def fold(
    events: DataFrame, cfg_off: Config, specs: list[MetricSpec], by_hash: int | None = None
) -> tuple[DataFrame, DataFrame]:
    """(exploded rows, folded cells) of `events` (`offline.events.archive_events`). With
    `by_hash`, the exploded rows are shuffled by slice hash (g, k) into that many partitions
    before they are folded: the fold needs no shuffle of its own, so the cells come out with
    each hash's in one partition after a single shuffle (a backfill's write wants them so)."""
    exploded = explode_updates(events, cfg_off, specs)
    rows = exploded if by_hash is None else exploded.repartition(by_hash, "g", "k")
    return exploded, fold_updates(rows, fold_columns(specs, audit=False))
