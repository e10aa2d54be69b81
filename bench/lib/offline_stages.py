"""The offline benchmark's `--part stages`: where a training set's time goes, on its archive.

Each step is a job Spark runs to its end with a no-op write (`noop`), so that it costs what the
step costs and nothing is written. The steps grow one stage at a time, from reading the archive
to the whole training set, so that each step's time less the one before is that stage's:

    read        the archive's columns, as `read_archive` reads them
    plan        + `archive_events` and the live fold's `explode_updates` (the rows a training
                  set's running totals take, one per event and key group)
    shuffle     + one shuffle by key (`repartition("k")`)
    text sort   + sorted by (key, time) within partitions: the order the running totals need,
                  the key compared as text (the training set's sort up to acd3eb2)
    hash sort   + instead grouped by the key's `xxhash64` (one long: a radix sort), as the
                  training set now does (the tasks sort each chunk by key and time in numpy)
    to Python   + the hash-sorted rows handed to a Python task as Arrow batches, which reads
                  them and yields nothing (`mapInArrow`)
    training set, range join   the whole jobs (`training_set`, `range_join`), their output
                  written to `noop` rather than Parquet
    carried     the training set with its answers never broadcast (`BROADCAST_BYTES` 0): the
                  spine's columns ride through the events' shuffle, and a sort by row id
                  restores the spine's order (what a spine too large to broadcast costs)

Steps alternate over rounds (the order reversed every other round); medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

STEPS = ("read", "plan", "shuffle", "text_sort", "hash_sort", "to_python", "training_set",
         "carried", "range_join")  # fmt: skip


def _noop(df: DataFrame) -> None:
    df.write.format("noop").mode("overwrite").save()


def steps(spark: Any, cfg: Any, events_dir: str, spine: DataFrame, windows: list[str]
          ) -> dict[str, Callable[[], DataFrame]]:  # fmt: skip
    """Each step's DataFrame, built anew at every call (module docstring)."""
    from lib.offline_training import features, range_join
    from sluice.offline.events import TimeBounds, archive_events, read_archive
    from sluice.offline.fold import offline_config, plan_specs, select_metrics
    from sluice.offline.training import training_set
    from sluice.pipeline.plan import explode_updates

    def drain(batches: Iterator[Any]) -> Iterator[Any]:  # nested: pickled by value
        for _ in batches:
            pass
        return iter(())

    names = list(features(windows))
    cfg_off = offline_config(cfg, select_metrics(cfg, names), finest_only=True)
    specs = plan_specs(spark, cfg_off)
    schema = cfg.source.schema_

    def archive() -> DataFrame:
        return read_archive(spark, events_dir, None, schema)

    def rows() -> DataFrame:
        exploded = explode_updates(archive_events(archive(), cfg_off, TimeBounds(), None),
                                   cfg_off, specs)  # fmt: skip
        return exploded.select("k", "t", *sorted({sp.column("v") for sp in specs}))

    def hashed() -> DataFrame:
        return rows().repartition("k").withColumn("_h", F.xxhash64("k")).sortWithinPartitions("_h")

    return {
        "read": lambda: archive().select(*schema),
        "plan": rows,
        "shuffle": lambda: rows().repartition("k"),
        "text_sort": lambda: rows().repartition("k").sortWithinPartitions("k", "t"),
        "hash_sort": hashed,
        "to_python": lambda: hashed().mapInArrow(drain, "x long"),
        "training_set": lambda: training_set(
            spark, cfg, spine, features(windows), "ts", events=archive()
        ),
        "carried": lambda: _never_broadcast(
            lambda: training_set(spark, cfg, spine, features(windows), "ts", events=archive())
        ),
        "range_join": lambda: range_join(spark, spark.read.parquet(events_dir), spine, windows),
    }


def _never_broadcast(build: Callable[[], DataFrame]) -> DataFrame:
    """`build()` with the training set's broadcast of answers off (it is read while the job is
    built, so it is restored at once)."""
    from sluice.offline import training

    was = training.BROADCAST_BYTES
    training.BROADCAST_BYTES = 0
    try:
        return build()
    finally:
        training.BROADCAST_BYTES = was


def stages_part(spark: Any, cfg: Any, events_dir: str, spine: DataFrame, windows: list[str],
                rounds: int, log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Every step once to warm the session, then `rounds` rounds: wall seconds per step."""
    made = steps(spark, cfg, events_dir, spine, windows)
    each: dict[str, list[float]] = {s: [] for s in STEPS}
    for rnd in range(rounds + 1):
        order = STEPS if rnd % 2 == 0 else tuple(reversed(STEPS))
        for step in order:
            t0 = time.perf_counter()
            _noop(made[step]())
            wall = time.perf_counter() - t0
            if rnd:  # round 0 warms the session
                each[step].append(wall)
            log(f"stages round {rnd}{' (warm-up)' if not rnd else ''}: {step} {wall:.1f} s")
    med = {s: statistics.median(v) for s, v in each.items()}
    return {"each_s": each, "median_s": med}
