"""The `sluice` command line (DESIGN §3): run, serve, demo, produce, query, status, dead-letters;
the offline commands are in `sluice.offline_cli` (backfill) and `sluice.training_cli`
(training-set, consistency, demo-offline).

Every command that reads a config goes through `commands.opened`: load the file, open its Redis
(the embedded one, started or joined, when `redis:` is not set), and turn any `SluiceError` into
one line on stderr and exit code 1. Commands that run Spark import it lazily: the others start
in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import click
import orjson
import redis

from sluice.clock import SYSTEM_CLOCK
from sluice.commands import StopSignals, config_option, handlers_kept, opened, stop_spark
from sluice.errors import SluiceError
from sluice.logs import LEVELS, LOG_LEVEL_ENV, SPARK_LOG_LEVEL_ENV, setup_logging
from sluice.offline_cli import COMMANDS as OFFLINE_COMMANDS
from sluice.redis.connection import client_for, redact
from sluice.status.dead_letters import read_dead_letters, reason_error
from sluice.status.snapshot import read_status
from sluice.status.views import format_dead_letters, format_dead_summary, format_status
from sluice.training_cli import COMMANDS as TRAINING_COMMANDS

log = logging.getLogger("sluice")


class _Commands(click.Group):
    """A Ctrl-C that no command handles itself (one while a command starts, before it installs
    its own handling) ends the process as SIGINT ends one: a line saying so and status 130,
    not click's `Aborted!` and status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            name = ctx.invoked_subcommand or "sluice"
            click.echo(f"{name}: stopped by SIGINT", err=True)
            raise SystemExit(128 + signal.SIGINT) from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    type=click.Choice(LEVELS, case_sensitive=False),
    default=None,
    help="sluice's own log level (default info; logs are key=value lines on stderr)",
)
@click.option("-v", "--verbose", is_flag=True, help="same as --log-level debug")
@click.option(
    "--spark-log-level",
    type=click.Choice(["error", "warn", "info", "debug"], case_sensitive=False),
    default=None,
    help="Spark's (JVM) log level (default error)",
)
@click.version_option(package_name="sluice")
@click.pass_context
def main(
    ctx: click.Context, log_level: str | None, verbose: bool, spark_log_level: str | None
) -> None:
    """Sluice: real-time per-entity metrics over any window."""
    level = "debug" if verbose else (log_level or os.environ.get(LOG_LEVEL_ENV) or "info")
    setup_logging(level)
    os.environ[LOG_LEVEL_ENV] = level.lower()  # the processes Spark starts log at it too
    ctx.obj = {"log_level": level.lower()}
    if spark_log_level:
        os.environ[SPARK_LOG_LEVEL_ENV] = spark_log_level.upper()


@main.command()
@config_option
@click.option(
    "--stage",
    "stages",
    multiple=True,
    help="run only this query (a stage's name, `fold:<stream>`, or `spark` for the source's"
    " fold); repeat it to run several. Default: all, in this one Spark application",
)
def run(config_path: str, stages: tuple[str, ...]) -> None:
    """Run the pipeline until SIGINT or SIGTERM, then stop cleanly."""
    signals = StopSignals()
    from sluice.pipeline.run import Pipeline, check_only, refuse_other_checkpoint
    from sluice.pipeline.spark import build_spark

    with opened(config_path) as (cfg, handle):
        check_only(cfg, stages)  # before Spark: a misspelt name is said at once
        refuse_other_checkpoint(cfg, handle.client, stages)
        if signals.stopping:  # before Spark: its JVM would start only to be stopped
            log.info("stopped before the pipeline started")
            return
        try:
            with handlers_kept():  # not PySpark's: it raises KeyboardInterrupt mid-call
                spark = build_spark(cfg)
        except Exception:
            if not signals.stopping:
                raise
            # A signal to the process group stops the JVM too, as it starts: nothing to stop
            log.debug("Spark's start cut short", exc_info=True)
            log.info("stopped before the pipeline started")
            return
        try:
            if signals.stopping:  # while Spark started: no pipeline, and Spark stopped
                log.info("stopped before the pipeline started")
            else:
                pipeline = Pipeline(cfg, handle, spark, only=stages)
                pipeline.prepare()
                signals.then(pipeline.request_stop)
                log.info(
                    "pipeline starting",
                    extra={"redis": redact(handle.url), "state_dir": str(cfg.state_dir),
                           "queries": len(pipeline.queries)},
                )  # fmt: skip
                pipeline.run_forever()
        except Exception:
            if not signals.stopping:
                raise
            log.debug("stopped while stopping", exc_info=True)
        finally:
            stop_spark(spark)
    log.info("stopped")


@main.command()
@config_option
@click.option("--host", default=None, help="bind address (default: server.host)")
@click.option("--port", default=None, type=int, help="port (default: server.port)")
@click.option(
    "--workers", default=None, type=int, help="worker processes (default: server.workers)"
)
@click.option(
    "--http",
    "http_server",
    default=None,
    type=click.Choice(["uvicorn", "granian"]),
    help="the HTTP server (default: server.http)",
)
def serve(
    config_path: str,
    host: str | None,
    port: int | None,
    workers: int | None,
    http_server: str | None,
) -> None:
    """Serve the HTTP API and the dashboard."""
    import uvicorn

    from sluice.pipeline.definitions import check_definitions
    from sluice.server.app import create_app

    with opened(config_path) as (cfg, handle):
        check_definitions(handle.client, cfg, register=False)  # answers of slices it would misread
        n_workers = workers if workers is not None else cfg.server.workers
        if n_workers < 1:
            raise click.ClickException(f"`--workers` must be at least 1, got {n_workers}")
        host = host or cfg.server.host
        port = port if port is not None else cfg.server.port
        bind = {
            "host": host,
            "port": port,
            # uvicorn logs through our handler (key=value lines); per-request lines stay off;
            # the latency of every request is in the Prometheus histogram instead.
            "log_config": None,
            "log_level": "warning",
            "access_log": False,
        }
        url = f"http://{bind['host']}:{bind['port']}/"
        server = http_server or cfg.server.http
        log.info("serving", extra={"url": url, "workers": n_workers, "http": server})
        with _signals_end_quietly():
            if server == "granian":
                _serve_granian(config_path, handle.local_url, host, port, n_workers)
            elif n_workers == 1:
                same = handle.local_url == handle.url
                client = handle.client if same else client_for(handle.local_url)
                uvicorn.run(create_app(cfg, client), **bind)  # type: ignore[arg-type]
            else:
                # Worker processes import the app factory; they find the config and Redis by
                # env, and write their request latencies where any of them can read all of
                # them for a scrape.
                _worker_env(config_path, handle.local_url)
                with _multiprocess_metrics_dir():
                    uvicorn.run(
                        "sluice.server.app:app_from_env",
                        factory=True,
                        workers=n_workers,
                        **bind,  # type: ignore[arg-type]
                    )
    log.info("stopped")


class _Signalled(Exception):
    """A stop signal, raised where the server gave it back (`_signals_end_quietly`)."""


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """A server stops on SIGINT or SIGTERM; uvicorn then raises the signal again for the process
    to die of it (status 143 for SIGTERM, a traceback for SIGINT). Here that ends the block
    instead, so that `serve` says it stopped and exits 0 however it serves."""

    def end(signum: int, _: Any) -> None:
        raise _Signalled(signum)

    before = {s: signal.signal(s, end) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _Signalled:
        pass
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _worker_env(config_path: str, redis_url: str) -> None:
    """What a worker process needs to build the app (`app_from_env`): the config and Redis, by
    environment (the log level is there already: `main` exported it)."""
    os.environ["SLUICE_CONFIG"] = str(Path(config_path).resolve())
    os.environ["SLUICE_REDIS_URL"] = redis_url


GRANIAN_KILL_AFTER_S = 2


def _serve_granian(config_path: str, redis_url: str, host: str, port: int, workers: int) -> None:
    """`serve` on granian: HTTP parsed and written in Rust, the same ASGI app in each worker
    process (built by `app_from_env`), as uvicorn runs it."""
    from granian.constants import Interfaces
    from granian.server import Server

    _worker_env(config_path, redis_url)
    with _multiprocess_metrics_dir():
        Server(
            "sluice.server.app:app_from_env",
            address=host,
            port=port,
            interface=Interfaces.ASGI,
            workers=workers,
            factory=True,
            log_enabled=False,
            websockets=False,
            # A worker that gets the stop signal itself as well as from the main process (Ctrl-C
            # reaches the whole process group) may never finish stopping: it is killed then.
            workers_kill_timeout=GRANIAN_KILL_AFTER_S,
        ).serve()


@contextlib.contextmanager
def _multiprocess_metrics_dir() -> Iterator[None]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for this server's workers (the official client's
    multiprocess mode), removed on exit. One set by the caller is used as it is."""
    from sluice.status.prometheus import MULTIPROC_ENV

    if os.environ.get(MULTIPROC_ENV):
        yield
        return
    path = tempfile.mkdtemp(prefix="sluice-metrics-")
    os.environ[MULTIPROC_ENV] = path
    try:
        yield
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event that SIGINT (Ctrl-C) and SIGTERM set while the block runs, instead of stopping
    the process in the middle of it; the handlers before come back after."""
    stop = threading.Event()
    before = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


class _Positive(click.ParamType):
    """A finite number above 0 (`nan`, `inf`, 0 and below are usage errors)."""

    name = "number"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not (0 < x < float("inf")):
            self.fail(f"must be a finite number above 0, got {value!r}", param, ctx)
        return x


POSITIVE = _Positive()


@main.command()
@config_option
@click.option("--rate", type=POSITIVE, required=True, help="events per second (base rate)")
@click.option("--duration", type=POSITIVE, required=True, help="seconds to produce for")
@click.option("--profile", type=click.Choice(["steady", "burst"]), default="steady",
              show_default=True)  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True,
              help="RNG seed for keys and values")  # fmt: skip
def produce(config_path: str, rate: float, duration: float, profile: str, seed: int) -> None:
    """Produce synthetic events (Zipf keys) into the source log for DURATION seconds, then
    print a JSON summary. Ctrl-C stops it early, with the summary. Events made while the input
    is over its high watermark are waited for up to 30 s after the duration; any still not
    admitted are reported (`unsent`, exit status 1), never written later. While Redis does not
    answer, the events made are kept and retried; after 30 s of that it stops, with the
    summary (exit status 1)."""
    from sluice.source.loadgen import DRAIN_S, Profile, run_load

    def progress(p: dict[str, Any]) -> None:
        line = f"produced {p['events']:,} events in {p['seconds']:.0f}s ({p['rate']:,.0f}/s)"
        if p.get("waiting"):
            line += (f"; waiting for the input to admit {p['waiting']:,} more (it is over its"
                     " high watermark: is `sluice run` draining it?)")  # fmt: skip
        if p.get("redis_down"):
            line += f"; Redis does not answer ({p['redis_down']}): events kept, retrying"
        click.echo(line, err=True)

    with opened(config_path) as (cfg, handle), _stop_on_signals() as stop:
        out = run_load(cfg, handle.client, rate, duration, Profile(profile), seed,
                       stop=stop.is_set, progress=progress)  # fmt: skip
    click.echo(json.dumps(out))
    if out["error"]:
        raise click.ClickException(f"{out['error']}: {out['unsent']:,} events made were not sent")
    if out["unsent"] and not stop.is_set():
        raise click.ClickException(
            f"{out['unsent']:,} events made were not admitted within {DRAIN_S:.0f}s after the"
            " duration: the input stayed over its high watermark (is `sluice run` draining it?)"
        )


@main.command()
@config_option
@click.argument("metric")
@click.option(
    "--key", "keys", multiple=True, required=True, help="key value (repeat for multi-field keys)"
)
@click.option("--window", required=True, help="window length, e.g. 15m")
@click.option("--end", type=int, default=None, help="window end in epoch ms (default now)")
def query(
    config_path: str, metric: str, keys: tuple[str, ...], window: str, end: int | None
) -> None:
    """Query METRIC for a key over the WINDOW that ends at --end (default: now)."""
    from sluice.pipeline.definitions import check_definitions
    from sluice.query.engine import QueryEngine

    with opened(config_path, reads_only=True) as (cfg, handle):
        check_definitions(handle.client, cfg, cfg.stored_inputs(metric), register=False)
        out = QueryEngine(cfg, handle.client).query(metric, list(keys), window, end)
    # As the HTTP API encodes it: a value that is not finite (a sum of doubles past the
    # largest double) is null, since JSON has no infinity.
    click.echo(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY).decode())


@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (one line)")
@click.option("-w", "--watch", is_flag=True, help="redraw every --interval seconds until Ctrl-C")
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
    help="seconds between redraws with --watch",
)  # fmt: skip
@click.option(
    "--count", type=click.IntRange(min=1), default=None, help="with --watch: stop after N views"
)
def status(
    config_path: str, as_json: bool, watch: bool, interval: float, count: int | None
) -> None:
    """Show the pipeline's state: rates, backlog, freshness, stages, audit books.

    With --watch, a terminal shows one view redrawn in place; a pipe or file gets one block per
    interval (one JSON line each with --json).
    """
    if not watch:
        source = click.get_current_context().get_parameter_source
        for name, flag in (("count", "--count"), ("interval", "--interval")):
            if source(name) is not click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"{flag} applies only with --watch")
    views = count if watch else 1
    redraw = watch and not as_json and sys.stdout.isatty()
    with (
        contextlib.suppress(KeyboardInterrupt),
        opened(config_path, reads_only=True) as (cfg, handle),
    ):
        shown = 0
        while views is None or shown < views:
            if shown:
                time.sleep(interval)
            shown += 1
            try:
                st = read_status(handle.client, cfg, SYSTEM_CLOCK.now_ms())
            except redis.RedisError as e:
                if not watch:
                    raise click.ClickException(str(e)) from None
                click.echo(f"--- {_stamp()}: redis is unavailable: {e}", err=True)
                continue
            if as_json:
                click.echo(json.dumps(st))
                continue
            text = format_status(st)
            if redraw:
                # Home the cursor and clear the screen, so the view stays in one place.
                click.echo("\x1b[H\x1b[2J" + _stamp() + "\n" + text, nl=True)
            elif watch:
                click.echo(f"--- {_stamp()}\n{text}\n")
            else:
                click.echo(text)


def _stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@main.command()
@click.option("--duration", type=POSITIVE, default=None, help="stop after this many seconds")
@click.option("--rate", type=POSITIVE, default=2000.0, show_default=True,
              help="base event rate (bursts are 10x)")  # fmt: skip
@click.option("--port", type=int, default=8000, show_default=True,
              help="API port (0 = any free port)")  # fmt: skip
@click.option("--state-dir", type=click.Path(file_okay=False), default=".sluice/demo",
              show_default=True)  # fmt: skip
def demo(duration: float | None, rate: float, port: int, state_dir: str) -> None:
    """Everything embedded: Redis, the Spark pipeline, the API and bursty synthetic load."""
    signals = StopSignals()
    from sluice.demo import run_demo

    try:
        run_demo(Path(state_dir), duration, rate, port, signals.requested, signals.install)
    except SluiceError as e:
        raise click.ClickException(str(e)) from None


@main.command("submit-path")
def submit_path() -> None:
    """Print the Python file to give spark-submit: spark-submit … "$(sluice submit-path)" run."""
    click.echo(str(resources.files("sluice.submit") / "spark_main.py"))


@main.command("dead-letters")
@config_option
@click.option(
    "--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="how many"
)
@click.option("--reason", default=None, help="only this reason, e.g. bad_json")
@click.option("--json", "as_json", is_flag=True, help="JSON lines on stdout, totals on stderr")
def dead_letters(config_path: str, limit: int, reason: str | None, as_json: bool) -> None:
    """Show the newest dead letters (newest first), their total and the count per reason."""
    why = None if reason is None else reason_error(reason)
    if why is not None:
        raise click.BadParameter(why, param_hint="--reason")
    with opened(config_path, reads_only=True) as (cfg, handle):
        out = read_dead_letters(handle.client, cfg, limit, reason)
    summary = format_dead_summary(out, cfg.source.dead_letter_stream, reason)
    if as_json:
        for item in out["items"]:
            click.echo(json.dumps(item, ensure_ascii=False))
        click.echo(summary, err=True)
        return
    click.echo(summary)
    if out["items"]:
        click.echo(format_dead_letters(out["items"], shutil.get_terminal_size((120, 24)).columns))


for command in (*OFFLINE_COMMANDS, *TRAINING_COMMANDS):
    main.add_command(command)

if __name__ == "__main__":  # pragma: no cover
    main()
