"""The commands of training sets and their checks (`COMMANDS`, added to `sluice` by
`sluice.cli`): `sluice training-set` (`sluice.offline.training`), `sluice consistency`
(`sluice.offline.consistency`) and `sluice demo-offline` (`sluice.demo_offline`). They share
the offline commands' TIME-free helpers (`offline_cli`): the Spark session, interrupts, input
checks.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sluice.commands import config_option, opened
from sluice.offline_cli import Interrupted, check_local_inputs, check_out_apart, spark_for
from sluice.units import duration_text, format_duration_ms

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json",
                  ".ndjson": "json"}  # fmt: skip


def read_table(
    spark: SparkSession, path: str, fmt: str | None, text: Sequence[str] = ()
) -> DataFrame:
    """A spine: Parquet, CSV (with a header; types inferred, but the `text` columns, its keys,
    read as they are written: `0042` stays `0042`) or JSON lines, by `fmt` or the path's
    suffix. Raises ArchiveError for a path Spark cannot read."""
    from pyspark.errors import AnalysisException
    from pyspark.sql.types import StringType, StructField, StructType

    from sluice.offline.events import ArchiveError
    from sluice.pipeline.schemas import CSV_OPTIONS

    fmt = fmt or next((f for s, f in _TABLE_FORMATS.items() if path.rstrip("/").endswith(s)),
                      "parquet")  # fmt: skip
    reader = spark.read.format("json" if fmt == "jsonl" else fmt)
    # A spine is small: a quoted field may span lines (a free-text column), read whole.
    csv_options = {**CSV_OPTIONS, "multiLine": "true"}
    if fmt == "csv":
        reader = reader.options(**csv_options)
    try:
        if fmt != "csv":
            return reader.load(path)
        inferred = reader.option("inferSchema", "true").load(path).schema
        schema = StructType([StructField(f.name, StringType() if f.name in text else f.dataType)
                             for f in inferred])  # fmt: skip
        return spark.read.format("csv").options(**csv_options).schema(schema).load(path)
    except AnalysisException as e:
        reason = str(e).strip().splitlines()[0]
        raise ArchiveError(f"cannot read {fmt} spine {path}: {reason}") from None


def parse_keys(values: tuple[str, ...]) -> dict[str, str]:
    """`--key card=card_id` as {"card": "card_id"}; a bad one is a usage error."""
    out: dict[str, str] = {}
    for v in values:
        field, sep, column = v.partition("=")
        if not sep or not field.strip() or not column.strip():
            raise click.BadParameter(f"{v!r} must be FIELD=COLUMN, e.g. card=card_id",
                                     param_hint="'--key'")  # fmt: skip
        field, column = field.strip(), column.strip()
        if out.get(field, column) != column:
            raise click.BadParameter(
                f"{field!r} is given twice, as {out[field]!r} and as {column!r}: give one",
                param_hint="'--key'",
            )
        out[field] = column
    return out


class _Stages(threading.Thread):
    """Prints the running job's tasks every `every_s` (what a lazy DataFrame's write does)."""

    def __init__(self, spark: SparkSession, what: str, say: Callable[[str], None],
                 every_s: float = 2.0) -> None:  # fmt: skip
        super().__init__(name="sluice-progress", daemon=True)
        self.spark, self.what, self.say, self.every_s = spark, what, say, every_s
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        tracker = self.spark.sparkContext.statusTracker()
        while not self.stopped.wait(self.every_s):
            try:
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
                done = sum(s.numCompletedTasks for s in stages if s)
                total = sum(s.numTasks for s in stages if s)
                elapsed = duration_text(time.monotonic() - self.t0)
                if not stages:  # between jobs: the driver plans, or collects an answer
                    self.say(f"{self.what}: planning, {elapsed}")
                    continue
                self.say(f"{self.what}: {len(stages)} stage(s) running, {done}/{total} tasks,"
                         f" {elapsed}")  # fmt: skip
            except Exception:  # noqa: BLE001 - progress never fails the job
                return


def _interrupted(what: str, e: Interrupted) -> None:
    click.echo(f"{what}: stopped by {signal.Signals(e.signum).name}", err=True)
    sys.exit(128 + e.signum)


@click.command("training-set")
@config_option
@click.option("--spine", required=True, metavar="PATH",
              help="the labelled rows: Parquet, CSV (with a header) or JSON lines")  # fmt: skip
@click.option("--ts", "ts", required=True, metavar="COLUMN",
              help="the spine's time column: epoch ms, a timestamp or ISO 8601 text")  # fmt: skip
@click.option("--out", required=True, metavar="PATH", help="where the table goes (Parquet)")
@click.option("--features", "features", multiple=True, required=True, metavar="METRIC:W1,W2",
              help="a metric (or derived metric) and its windows, e.g. txn_count:10m,1h,7d;"
              " repeat for more")  # fmt: skip
@click.option(
    "--key",
    "keys",
    multiple=True,
    metavar="FIELD=COLUMN",
    help="the spine column that holds a metric's key field, where the names differ",
)
@click.option("--input", "inputs", multiple=True, metavar="PATH",
              help="archived events (any history); without it, the store answers what it can"
              " answer exactly")  # fmt: skip
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl", "csv"]), default=None,
              help="the input's format (default: from its suffix, else parquet)")  # fmt: skip
@click.option("--as-known-at", "--arrival", "arrival", default=None, metavar="COLUMN",
              help="the archive's arrival-time column (epoch ms, a timestamp, ISO 8601 or a"
              " Redis Stream entry id): count only events that had arrived by each row's"
              " time")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="replace --out if it exists")
def training_set(
    config_path: str, spine: str, ts: str, out: str, features: tuple[str, ...],
    keys: tuple[str, ...], inputs: tuple[str, ...], fmt: str | None, arrival: str | None,
    overwrite: bool,
) -> None:  # fmt: skip
    """Add to every spine row each feature's value as the service would have answered at the
    row's time (no event after it counts), for windows chosen here. See docs/offline.md."""
    key_map = parse_keys(keys)
    if arrival and not inputs:
        raise click.BadParameter("needs --input: the store does not keep arrival times",
                                 param_hint="'--as-known-at'")  # fmt: skip
    check_out_apart(out, {"spine": (spine,), "input": inputs})
    if Path(out).exists() and not overwrite:
        raise click.ClickException(f"{out} exists; pass --overwrite to replace it")
    t0 = time.monotonic()
    try:
        with opened(config_path) as (cfg, handle):
            from pyspark.sql import functions as F

            from sluice.offline.events import (
                TimeBounds,
                archive_events,
                read_archive,
                read_failures,
                to_ms,
            )
            from sluice.offline.features import (
                bad_rows,
                events_reach,
                key_columns,
                parse_features,
                reach_problems,
                spine_problems,
            )
            from sluice.offline.store import UNANSWERED
            from sluice.offline.training import training_set as build

            feats = parse_features(cfg, list(features))  # bad names and windows: before Spark
            check_local_inputs((spine,), "spine")
            check_local_inputs(inputs)
            with spark_for(cfg, "sluice-training-set") as spark:
                key_cols = key_columns(cfg, feats, key_map)
                rows = read_table(spark, spine, None, list(key_cols))
                spine_warnings: list[str] = []
                if ts in rows.columns:  # else the job's own check says so
                    t = to_ms(F.col(f"`{ts}`"), rows.schema[ts].dataType)
                    keyed = {c: spec for c, spec in key_cols.items() if c in rows.columns}
                    spine_warnings = spine_problems(rows, t, ts, keyed)
                for line in spine_warnings:
                    click.echo(f"training-set: warning: {line}", err=True)
                events = read_archive(spark, list(inputs), fmt, cfg.source.schema_) if inputs \
                    else None  # fmt: skip
                table = build(spark, cfg, rows, list(features), ts=ts, keys=key_map,
                              events=events, arrival=arrival, url=handle.url)  # fmt: skip
                say = lambda line: click.echo(line, err=True)  # noqa: E731
                progress = _Stages(spark, "training-set", say)
                progress.start()
                try:
                    with read_failures():
                        table.write.mode("overwrite").parquet(out)
                finally:
                    progress.stopped.set()
                written = spark.read.parquet(out)
                n = written.count()
                unanswered = (
                    written.where(f"size({UNANSWERED}) > 0").count()
                    if UNANSWERED in written.columns else 0
                )  # fmt: skip
                added = [c for c in written.columns if c not in rows.columns]
                bad: dict[str, tuple[int, str]] = {}
                input_warnings: list[str] = []
                if events is not None:  # of the event times the table read (`events_reach`)
                    bounds = rows.select(F.min(t), F.max(t)).first() if ts in rows.columns \
                        else None  # fmt: skip
                    reach = events_reach(cfg, feats, *(bounds or (None, None)))
                    bad, used = bad_rows(archive_events(events, cfg, reach, arrival=arrival))
                    if not used and n:
                        every = archive_events(events, cfg, TimeBounds(), arrival=arrival)
                        input_warnings = reach_problems(every, reach)
    except Interrupted as e:
        _interrupted("training-set", e)
    elapsed_s = round(time.monotonic() - t0, 1)
    summary = {"out": out, "rows": n, "columns": added, "unanswered_rows": unanswered,
               "bad_rows": {r: c for r, (c, _) in bad.items()}, "spine_warnings": spine_warnings,
               "input_warnings": input_warnings, "elapsed_s": elapsed_s}  # fmt: skip
    click.echo(f"training-set: {n:,} rows -> {out} in {duration_text(elapsed_s)};"
               f" added {', '.join(added)}", err=True)  # fmt: skip
    if bad:
        click.echo(f"  bad input rows: {sum(c for c, _ in bad.values()):,}, counted in no"
                   " feature (the live fold dead-letters them too)", err=True)  # fmt: skip
        width = max(len(r) for r in bad)
        for reason, (c, sample) in sorted(bad.items(), key=lambda kv: -kv[1][0]):
            sample = sample if len(sample) <= 160 else sample[:157] + "..."
            click.echo(f"    {reason:<{width}}  {c:>9,}  e.g. {sample}", err=True)
    for line in input_warnings:
        click.echo(f"training-set: warning: {line}", err=True)
    if unanswered:
        click.echo(f"  {unanswered:,} rows have features the store could not answer exactly"
                   f" (see their {UNANSWERED} column; give --input)", err=True)  # fmt: skip
    click.echo(json.dumps(summary))


@click.command("consistency")
@config_option
@click.option(
    "--input",
    "inputs",
    multiple=True,
    required=True,
    metavar="PATH",
    help="archived events: the history the logged answers are recomputed from",
)
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl", "csv"]), default=None,
              help="the input's format (default: from its suffix, else parquet)")  # fmt: skip
@click.option("--sample", type=click.IntRange(min=1), default=1000, show_default=True,
              help="how many of the newest logged answers to check")  # fmt: skip
@click.option("--as-known-at", "--arrival", "arrival", default=None, metavar="COLUMN",
              help="the archive's arrival-time column: an answer is held only to the events"
              " that had arrived when it was served")  # fmt: skip
@click.option(
    "--settle",
    default="2s",
    show_default=True,
    help="skip answers served less than this after their last slice ended",
)
@click.option("--json", "as_json", is_flag=True, help="print only the report, as one JSON line")
def consistency(
    config_path: str, inputs: tuple[str, ...], fmt: str | None, sample: int,
    arrival: str | None, settle: str, as_json: bool,
) -> None:  # fmt: skip
    """Recompute a sample of the answers the server gave (server.log_answers) from the archive,
    and report matched, mismatched, missing and skipped per metric. Exits 3 on a mismatch, and
    4 when nothing was compared (no answer logged, or every one missing or skipped). See
    docs/offline.md."""
    from sluice.units import parse_duration_ms

    try:
        settle_ms = parse_duration_ms(settle)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--settle'") from None
    try:
        with opened(config_path) as (cfg, handle):
            from sluice.offline.consistency import check, nothing_logged
            from sluice.offline.events import read_archive, read_failures

            check_local_inputs(inputs)
            empty = nothing_logged(handle.client, ", ".join(inputs))
            if empty is not None:
                report = empty
            else:
                with spark_for(cfg, "sluice-consistency") as spark:
                    events = read_archive(spark, list(inputs), fmt, cfg.source.schema_)
                    with read_failures():
                        report = check(spark, cfg, handle.client, events, ", ".join(inputs),
                                       sample, arrival, settle_ms)  # fmt: skip
    except Interrupted as e:
        _interrupted("consistency", e)
    if not as_json:
        click.echo(
            f"consistency: {report.matched:,} matched, {report.mismatched:,} mismatched,"
            f" {report.missing:,} missing, {report.skipped:,} skipped of {report.samples:,}"
            " logged answers", err=True,
        )  # fmt: skip
        if 0 < report.samples < sample:
            click.echo(f"  (--sample {sample:,}: the store held {report.samples:,} logged"
                       " answers; it keeps the newest server.log_answers_max)",
                       err=True)  # fmt: skip
        for name, counts in sorted(report.metrics.items()):
            click.echo(f"  {name:<24} " + ", ".join(f"{v:,} {k}" for k, v in counts.items()),
                       err=True)  # fmt: skip
        for ex in report.examples[:5]:
            window = format_duration_ms(ex["window_ms"])
            click.echo(f"  mismatch: {ex['metric']} {ex['key']} window {window}"
                       f" end {ex['end_ms']}: online {ex['online']}, offline {ex['offline']}",
                       err=True)  # fmt: skip
    click.echo(json.dumps(report.as_dict()))
    if report.mismatched:
        sys.exit(3)  # scripts and CI can act on it
    if not report.samples:
        click.echo(
            "consistency: nothing was checked: the store holds no logged answers. The server"
            " logs a sample of what it answers (server.log_answers, here"
            f" {cfg.server.log_answers:g}); serve queries first",
            err=True,
        )
        sys.exit(4)  # a check of nothing is no pass
    if not report.matched:
        click.echo(
            f"consistency: no answer was compared: {report.missing:,} missing,"
            f" {report.skipped:,} skipped (is --input the archive of these events, and does it"
            " cover the times they were served at?)",
            err=True,
        )
        sys.exit(4)


@click.command("demo-offline")
@click.option("--events", type=click.IntRange(min=1000), default=300_000, show_default=True)
@click.option("--rows", type=click.IntRange(min=10), default=2_000, show_default=True)
@click.option("--state-dir", default=".sluice-demo", show_default=True)
def demo_offline(events: int, rows: int, state_dir: str) -> None:
    """The offline side end to end: an archive, sluice backfill, a training table for windows
    chosen now, and the consistency check, on an embedded Redis and a local Spark."""
    from sluice.demo_offline import offline_demo_config, run_offline_demo

    cfg = offline_demo_config(Path(state_dir))
    click.echo("starting Spark (takes a few seconds)...", err=True)
    try:
        with spark_for(cfg, "sluice-demo-offline") as spark:
            run_offline_demo(Path(state_dir), events=events, rows=rows, spark=spark)
    except Interrupted as e:
        _interrupted("demo-offline", e)


COMMANDS: tuple[Any, ...] = (training_set, consistency, demo_offline)
