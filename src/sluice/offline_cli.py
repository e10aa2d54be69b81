"""The offline commands (`COMMANDS`, added to `sluice` by `sluice.cli`): `sluice backfill`
(`sluice.offline.backfill`), and what every offline command shares: the TIME option
(`parse_time_ms`), the Spark session for a config (`spark_for`), which Ctrl-C or SIGTERM
interrupts with `Interrupted`, and the checks made before Spark starts.

Each command opens its config and Redis with `commands.opened` (a `SluiceError` is one line on
stderr, exit 1), checks what it can before starting Spark (metric names, local input paths, the
bounds), and imports Spark and the offline package only inside the command: `sluice --help` and
the other commands do not pay for them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import redis

from sluice.commands import StopSignals, config_option, handlers_kept, opened, stop_spark
from sluice.config import Config
from sluice.errors import ConfigError
from sluice.pipeline import jvm_stderr
from sluice.redis.connection import server_now_ms
from sluice.units import EPOCH, duration_text, iso_ms

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sluice.offline.backfill import BackfillReport

_EPOCH_MS = re.compile(r"-?\d+")
_GLOB = re.compile(r"[*?\[{]")


def parse_time_ms(text: str) -> int:
    """TIME as epoch ms: an integer is epoch ms as it is; anything else is ISO 8601, a date
    (`2026-11-01`, midnight) or a date and time (`2026-11-01T12:00:00`, `…Z`, `…+02:00`, a space
    for the `T`). A time without an offset is UTC, not the machine's local time. Raises
    ValueError naming the value and the forms taken."""
    value = text.strip()
    if _EPOCH_MS.fullmatch(value):
        return int(value)
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither epoch ms nor an ISO 8601 time; use e.g. 1793534400000,"
            " 2026-11-01, 2026-11-01T12:00:00Z or 2026-11-01T14:00:00+02:00"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    delta = when - EPOCH  # exact: no float on the way, so no time is off by a millisecond
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


class TimeParam(click.ParamType):
    """A click option's TIME (`parse_time_ms`); a bad one is a usage error naming the option."""

    name = "TIME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_time_ms(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


TIME = TimeParam()


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM stopped a `spark_for` block; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """The first SIGINT or SIGTERM raises KeyboardInterrupt in the main thread (in whatever
    Spark call it waits on); later ones are ignored, so that the stop is not interrupted.
    While `deferred` (Spark starting) it is only noted: cut short, PySpark's start leaves its
    JVM running with no one to stop it (its gateway waits for a driver that is gone)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = True
        self.deferred = False

    def install(self) -> None:
        # Again after Spark starts: PySpark's context puts a SIGINT handler of its own in place.
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, _: Any) -> None:
        if self.signum is not None or not self.armed:
            return
        self.signum = signum
        jvm_stderr.stopping()
        # Ctrl-C signals the whole process group, Spark's JVM included: what fails now is
        # expected, and its loggers stay quiet.
        StopSignals.quiet()
        if not self.deferred:
            raise KeyboardInterrupt


@contextlib.contextmanager
def spark_for(cfg: Config, app_name: str, then: str = "") -> Iterator[SparkSession]:
    """A Spark session for `cfg` (`build_spark`), stopped quietly when the block ends. The first
    Ctrl-C or SIGTERM while the block runs interrupts it: whatever it raised becomes
    `Interrupted`. One while Spark starts takes effect once it has started, so that its JVM is
    stopped too. A job that failed in a Python task (a Redis that refused a
    write, a lost connection) becomes one line with the task's error, and `then` (what to do
    next), as does a Redis error of the block's own calls. Blocks while Spark starts
    (seconds)."""
    from sluice.pipeline.spark import build_spark

    jvm_stderr.batch_jobs()  # their failures end in one line of ours, not Spark's traces first
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    interrupts = _Interrupts()
    interrupts.install()
    spark = None
    try:
        interrupts.deferred = True  # a signal now stops Spark once it has started
        with handlers_kept():
            spark = build_spark(cfg, app_name=app_name, sources=False)  # files, not the log
        interrupts.deferred = False
        interrupts.install()
        if interrupts.signum is not None:
            raise KeyboardInterrupt
        yield spark
    except BaseException as e:
        interrupts.armed = False
        if interrupts.signum is not None:
            raise Interrupted(interrupts.signum) from None
        if isinstance(e, KeyboardInterrupt):  # a SIGINT that reached another handler
            StopSignals.quiet()
            raise Interrupted(signal.SIGINT) from None
        if isinstance(e, redis.RedisError):  # the driver's own calls: seams, runs, progress
            raise click.ClickException(f"redis: {e}{then}") from None
        why = task_error(e)
        if why is None:
            raise
        raise click.ClickException(f"a Spark task failed: {why}{then}") from None
    finally:
        interrupts.armed = False
        if spark is not None:
            stop_spark(spark)
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def task_error(e: BaseException) -> str | None:
    """The Python error a Spark job failed with, as its traceback's last line (`Type: message`,
    the type without its module), or None when `e` is not a failed Python task of Spark's."""
    if not type(e).__module__.startswith(("pyspark", "py4j")):
        return None
    lines = str(e).splitlines()
    try:
        at = next(i for i, x in enumerate(lines) if x.startswith("Traceback (most recent call"))
    except StopIteration:
        return None
    last = None  # the last error line: an error raised while handling another comes after it
    for line in lines[at + 1 :]:
        if line.startswith("JVM stacktrace"):
            break
        if line and not line[0].isspace() and not line.startswith(_NOT_ERRORS):
            last = line
    if last is None:
        return None
    kind, sep, message = last.partition(": ")
    return f"{kind.rsplit('.', 1)[-1]}: {message}" if sep else last


_NOT_ERRORS = ("Traceback (most recent call", "During handling of", "The above exception")


def check_local_inputs(paths: tuple[str, ...], what: str = "input") -> None:
    """Fail before Spark starts for a local path (no URL scheme) that is not there, or a local
    glob that matches nothing, naming it as `what`. Raises ArchiveError; other paths are
    Spark's to read (and to fail on)."""
    from sluice.offline.events import ArchiveError

    for p in paths:
        if "://" in p or p.startswith("file:"):
            continue
        if _GLOB.search(p):
            # Hadoop's globs also have {a,b} and [^a], which Python's do not: Spark's to read
            if "{" not in p and "[^" not in p and not glob.glob(os.path.expanduser(p)):
                raise ArchiveError(f"{what} {p!r} matches no file or directory")
            continue
        if not Path(p).exists():
            raise ArchiveError(f"{what} {p!r} does not exist (no such file or directory)")


def check_out_apart(out: str, reads: dict[str, tuple[str, ...]]) -> None:
    """Fail before Spark starts where `--out`, which an overwrite deletes before the job reads
    anything, is a path the job reads (`reads`: what each is called -> its paths), holds one or
    lies inside one, or matches a glob of them. Local paths only."""
    if "://" in out:
        return
    target = Path(out.removeprefix("file:")).expanduser().resolve()
    for what, paths in reads.items():
        for p in paths:
            if "://" in p:
                continue
            p_local = p.removeprefix("file:")
            glob = _GLOB.search(p_local)
            if glob:  # the folder before the glob's first wild part, and the pattern below it
                cut = p_local.rfind("/", 0, glob.start()) + 1
                base = Path(p_local[:cut] or ".").expanduser().resolve()
                wild = p_local[cut:].split("/")
                # --out holds the folder, or lies along the pattern: it holds a path the glob
                # matches, is one, or lies inside one
                hit = (
                    target == base
                    or target in base.parents
                    or (
                        base in target.parents
                        and all(map(fnmatchcase, target.relative_to(base).parts, wild))
                    )
                )
            else:
                base = Path(p_local).expanduser().resolve()
                hit = base == target or target in base.parents or base in target.parents
            if hit:
                raise click.BadParameter(
                    f"{out!r} would overwrite the {what} {p!r}, which the job reads (an"
                    " overwrite deletes it before anything is read): write elsewhere",
                    param_hint="'--out'",
                )


def metric_names(values: tuple[str, ...]) -> list[str] | None:
    """`--metrics a,b --metrics c` as [a, b, c]; None (all metrics) when not given. An empty
    name (`--metrics ""`, `a,,b`, a trailing comma) is a usage error, never "all"."""
    if not values:
        return None
    names = [n.strip() for v in values for n in v.split(",")]
    if not all(names):
        raise click.BadParameter(
            f"{','.join(values)!r} holds an empty metric name; name each metric, comma-separated,"
            " or leave --metrics out for all of them",
            param_hint="--metrics",
        )
    return names


# -- sluice backfill --------------------------------------------------------------------------


def format_progress(p: dict[str, Any]) -> str:
    """One progress line from a backfill's progress snapshot (`offline.progress.Watcher`)."""
    elapsed = duration_text(p["elapsed_s"])
    if p["phase"] == "planning":
        return f"backfill: reading the archive and planning, {elapsed}"
    if p["phase"] == "reading":
        return (f"backfill: reading and shuffling the archive, {p['tasks_done']:,}/{p['tasks']:,}"
                f" tasks, {elapsed}")  # fmt: skip
    parts = [f"{p['partitions_done']:,}/{p['partitions']:,} partitions written",
             f"{p['events']:,} events read", f"{p['slices']:,} slices written"]  # fmt: skip
    if p["events_per_s"]:
        parts.append(f"{p['events_per_s']:,} events/s")
    if p["partitions_done"] >= p["partitions"] or p["left_s"] == 0:
        parts.append("finishing")  # (the running tasks' writes are all sent)
    elif p["left_s"] is not None:
        parts.append(f"about {duration_text(p['left_s'])} left")
    return "backfill: " + ", ".join(parts)


def format_summary(report: BackfillReport) -> str:
    """The report for people (stderr): counts, seams as ISO times, bad rows with a sample of
    each reason, partitions skipped, warnings, time taken."""
    lines = [
        f"backfill {report.run}: {report.events:,} events folded into {report.slices:,} slices"
        f" of {len(report.metrics)} metric{'s' if len(report.metrics) != 1 else ''}"
        f" in {duration_text(report.elapsed_s)}"
    ]
    by_seam: dict[int, list[str]] = {}
    for name, seam in report.seams.items():
        by_seam.setdefault(seam, []).append(name)
    for seam, names in sorted(by_seam.items()):
        lines.append(f"  seam {iso_ms(seam)} ({seam}): {', '.join(names)}")
    by_first: dict[int, list[str]] = {}
    for name, first in report.first_slices.items():
        if first is not None:
            by_first.setdefault(first, []).append(name)
    for first, names in sorted(by_first.items()):  # --start, down to each metric's slice
        lines.append(f"  from {iso_ms(first)} (--start): {', '.join(names)}")
    lines.append(
        "  slices before each seam are the archive's (written now); after it, the live fold's"
    )
    # Bad rows are counted as a partition is read: none of those an earlier run wrote.
    some = ", in the partitions written now" if report.partitions_skipped else ""
    if report.dead:
        lines.append(f"  bad rows: {sum(report.dead.values()):,} (not folded{some})")
        width = max(len(r) for r in report.dead)
        for reason, n in sorted(report.dead.items(), key=lambda kv: -kv[1]):
            sample = (report.samples.get(reason) or [""])[0]
            sample = sample if len(sample) <= 160 else sample[:157] + "..."
            lines.append(f"    {reason:<{width}}  {n:>9,}  e.g. {sample}")
    elif report.partitions and report.partitions == report.partitions_skipped:
        lines.append("  bad rows: not counted (no partition was read)")
    else:
        lines.append(f"  bad rows: none{some}")
    written = report.partitions - report.partitions_skipped
    line = f"  partitions: {written:,} written"
    if report.partitions_skipped:
        line += f", {report.partitions_skipped:,} skipped (written by an earlier run of it)"
    lines.append(line)
    if report.partitions and not written:
        lines.append(
            "  nothing to do: an earlier run of it wrote every partition (--fresh writes again)"
        )
    if report.after_seam:
        lines.append(f"  left to the live fold: {report.after_seam:,} slices at or after a seam")
    if report.before_start:
        lines.append(f"  not read: {report.before_start:,} rows before --start")
    if report.after_until:
        lines.append(
            f"  not read: {report.after_until:,} rows at or after the newest seam (the live"
            f" fold's; --until was {iso_ms(report.until_ms)}, {report.until_ms})"
        )
    if not report.events and not report.dead and report.partitions > report.partitions_skipped:
        lines.append("  warning: the input held no event to fold between --start and --until")
    if report.expired:
        lines.append(f"  not written: {report.expired:,} slices past their retention")
    lines += [f"  warning: {w}" for w in report.warnings]
    return "\n".join(lines)


@click.command("backfill")
@config_option
@click.option(
    "--input", "inputs", multiple=True, required=True, metavar="PATH",
    help="archived events: a file, a directory, a glob or any URL Spark reads; repeat for more",
)  # fmt: skip
@click.option(
    "--format", "fmt", type=click.Choice(["parquet", "jsonl", "csv"]), default=None,
    help="the input's format (default: from the first path's suffix, else parquet)",
)  # fmt: skip
@click.option(
    "--metrics", "metrics", multiple=True, metavar="M1,M2",
    help="only these metrics, comma-separated (default: all that fold the source's events)",
)  # fmt: skip
@click.option(
    "--start",
    "start_ms",
    type=TIME,
    default=None,
    help="first event time: epoch ms or ISO 8601 (UTC unless it says otherwise)",
)
@click.option(
    "--until", "until_ms", type=TIME, default=None,
    help="end of the backfill (exclusive), rounded down to each metric's coarsest slice: its"
    " seam. Epoch ms or ISO 8601; default: the store's clock now",
)  # fmt: skip
@click.option(
    "--fresh",
    is_flag=True,
    help="write every partition again, even those an earlier run of it wrote",
)
@click.option("--json", "as_json", is_flag=True, help="print only the report, as one JSON line")
@click.option("--progress-every", "progress_every_s", type=click.FloatRange(min=0.1),
              default=2.0, hidden=True)  # fmt: skip
def backfill(
    config_path: str,
    inputs: tuple[str, ...],
    fmt: str | None,
    metrics: tuple[str, ...],
    start_ms: int | None,
    until_ms: int | None,
    fresh: bool,
    as_json: bool,
    progress_every_s: float,
) -> None:
    """Fold archived events into the slice store with the live fold's plan.

    Slices before each metric's seam (--until, rounded down to its coarsest slice) are replaced
    by the archive's; the live fold keeps the rest. Progress and a summary go to stderr, the
    report as one JSON line to stdout. Interrupted, it can be run again: the partitions it wrote
    are skipped, and the slices end exact.
    """
    if start_ms is not None and until_ms is not None and start_ms >= until_ms:
        raise click.BadParameter(
            f"must be after `--start` ({iso_ms(start_ms)}), got {iso_ms(until_ms)}",
            param_hint="'--until'",
        )
    names = metric_names(metrics)
    t0 = time.monotonic()
    interrupted = False

    def progress(p: dict[str, Any]) -> None:
        if not interrupted:
            click.echo(format_progress(p), err=True)

    try:
        with opened(config_path) as (cfg, handle):
            from sluice.offline.backfill import backfill as run_backfill
            from sluice.offline.fold import select_metrics

            try:  # unknown names fail before Spark starts
                select_metrics(cfg, names)
            except ConfigError as e:
                if names is None:
                    raise
                raise click.BadParameter(str(e), param_hint="'--metrics'") from None
            check_local_inputs(inputs)
            now_ms = server_now_ms(handle.client)
            if until_ms is None:  # now, by the store's clock: said on Ctrl-C, to run again
                until_ms = now_ms
            elif until_ms > now_ms:  # before Spark starts (the backfill says so too)
                raise click.BadParameter(
                    f"{iso_ms(until_ms)} is after the store's clock ({iso_ms(now_ms)}): the"
                    " slices from now on belong to the live fold; leave it out to backfill up"
                    " to now",
                    param_hint="'--until'",
                )
            again = (". What the store took stays: the same backfill run again skips the"
                     " partitions it wrote and writes the rest (exact)")  # fmt: skip
            with spark_for(cfg, "sluice-backfill", again) as spark:
                report = run_backfill(
                    spark, cfg, list(inputs), fmt, names, start_ms, until_ms,
                    url=handle.url, fresh=fresh, progress_every_s=progress_every_s,
                    progress=None if as_json else progress,
                )  # fmt: skip
    except Interrupted as e:
        interrupted = True
        click.echo(
            f"backfill: stopped by {signal.Signals(e.signum).name} after"
            f" {duration_text(time.monotonic() - t0)}. Run it again with --until {until_ms} to"
            " finish: the partitions written so far are skipped, and what was half written is"
            " written again (a backfill's slices replace, so the result is exact)",
            err=True,
        )
        sys.exit(128 + e.signum)
    if not as_json:
        click.echo(format_summary(report), err=True)
    click.echo(json.dumps(report.as_dict()))


COMMANDS = (backfill,)  # what `sluice.cli` adds to `main`: a new offline command goes here
