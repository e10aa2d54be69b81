"""The `sluice` command line (DESIGN §3): run, serve, demo, produce, query, status, dead-letters."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from sluice.config import Config, load_config
from sluice.errors import SluiceError

log = logging.getLogger("sluice")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
        stream=sys.stderr,
    )
    for noisy in ("py4j", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(path: str) -> Config:
    try:
        return load_config(path)
    except SluiceError as e:
        raise click.ClickException(str(e)) from None


def _fail(e: Exception) -> click.ClickException:
    return click.ClickException(str(e))


config_option = click.option(
    "-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False),
    help="path to sluice.yaml",
)  # fmt: skip


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
@click.version_option(package_name="sluice")
def main(verbose: bool) -> None:
    """Sluice: real-time per-entity metrics over any window."""
    setup_logging(verbose)


@main.command()
@config_option
def run(config_path: str) -> None:
    """Run the pipeline until SIGINT or SIGTERM, then stop cleanly."""
    from sluice.pipeline.job import Pipeline
    from sluice.pipeline.spark import build_spark
    from sluice.redis.connection import open_redis

    cfg = _load(config_path)
    try:
        handle = open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability)
    except SluiceError as e:
        raise _fail(e) from None
    with handle:
        spark = build_spark(cfg)
        try:
            pipeline = Pipeline(cfg, handle, spark)
        except SluiceError as e:
            raise _fail(e) from None

        def on_signal(signum: int, _: Any) -> None:
            log.info("signal %s: stopping after the batch in flight", signal.Signals(signum).name)
            pipeline.request_stop()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        log.info("pipeline running; redis=%s checkpoint=%s", _redact(handle.url), pipeline.ckpt)
        pipeline.run_forever()
        spark.stop()
    log.info("stopped")


def _redact(url: str) -> str:
    from sluice.redis.connection import redact

    return redact(url)


@main.command()
@config_option
@click.option("--host", default=None, help="bind address (default: server.host)")
@click.option("--port", default=None, type=int, help="port (default: server.port)")
@click.option(
    "--workers", default=None, type=int, help="worker processes (default: server.workers)"
)
def serve(config_path: str, host: str | None, port: int | None, workers: int | None) -> None:
    """Serve the HTTP API and the dashboard."""
    import uvicorn

    from sluice.query.app import create_app
    from sluice.redis.connection import open_redis

    cfg = _load(config_path)
    try:
        handle = open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability)
    except SluiceError as e:
        raise _fail(e) from None
    n_workers = workers if workers is not None else cfg.server.workers
    if n_workers < 1:
        raise click.ClickException(f"`--workers` must be at least 1, got {n_workers}")
    bind = {
        "host": host or cfg.server.host,
        "port": port if port is not None else cfg.server.port,
        "log_level": "warning",
    }
    with handle:
        if n_workers == 1:
            uvicorn.run(create_app(cfg, handle.client), **bind)  # type: ignore[arg-type]
        else:
            # Worker processes import the app factory; they find the config and Redis by env.
            os.environ["SLUICE_CONFIG"] = str(Path(config_path).resolve())
            os.environ["SLUICE_REDIS_URL"] = handle.url
            uvicorn.run(
                "sluice.query.app:app_from_env",
                factory=True,
                workers=n_workers,
                **bind,  # type: ignore[arg-type]
            )


@main.command()
@config_option
@click.option("--rate", type=float, required=True, help="events per second (base rate)")
@click.option("--duration", type=float, required=True, help="seconds to produce for")
@click.option("--profile", type=click.Choice(["steady", "burst"]), default="steady")
@click.option("--seed", type=int, default=0, help="RNG seed for keys and values")
def produce(config_path: str, rate: float, duration: float, profile: str, seed: int) -> None:
    """Produce synthetic events (Zipf keys) into the input streams."""
    from sluice.redis.connection import open_redis
    from sluice.source.loadgen import Profile, run_load

    if rate <= 0 or duration <= 0:
        raise click.ClickException("`--rate` and `--duration` must be positive")
    cfg = _load(config_path)
    try:
        handle = open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability)
    except SluiceError as e:
        raise _fail(e) from None

    def progress(p: dict[str, Any]) -> None:
        click.echo(
            f"produced {p['events']:,} events in {p['seconds']:.0f}s ({p['rate']:,.0f}/s)", err=True
        )

    with handle:
        out = run_load(
            cfg, handle.client, rate, duration, Profile(profile), seed, progress=progress
        )
    click.echo(json.dumps(out))


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
    """Query METRIC for a key over the last WINDOW."""
    from sluice.query.engine import QueryEngine
    from sluice.redis.connection import open_redis

    cfg = _load(config_path)
    try:
        with open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability) as handle:
            out = QueryEngine(cfg, handle.client).query(metric, list(keys), window, end)
    except SluiceError as e:
        raise _fail(e) from None
    click.echo(json.dumps(out))


@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(config_path: str, as_json: bool) -> None:
    """Show backlog, rates, freshness and counters."""
    from sluice.clock import SYSTEM_CLOCK
    from sluice.pipeline.status import read_status
    from sluice.redis.connection import open_redis

    cfg = _load(config_path)
    try:
        with open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability) as handle:
            st = read_status(handle.client, cfg, SYSTEM_CLOCK.now_ms())
    except SluiceError as e:
        raise _fail(e) from None
    if as_json:
        click.echo(json.dumps(st))
        return
    click.echo(format_status(st))


def format_status(st: dict[str, Any]) -> str:
    c = st["counters"]
    f = st["freshness_ms"]
    pipe = st.get("pipeline") or {"state": "unknown"}
    state = pipe["state"]
    if pipe.get("consecutive_failures"):
        state += f" ({pipe['consecutive_failures']} failures in a row: {pipe.get('last_error')})"
    rows = [
        ("pipeline", state),
        ("backlog (entries)", f"{st['backlog']['entries']:,}"),
        ("backlog (bytes)", _size(st["backlog"].get("bytes"))),
        ("processed events/s", f"{st['processed_events_per_s']:,.0f}"),
        ("freshness p50 / p99", f"{_ms(f['p50'])} / {_ms(f['p99'])}"),
        (
            "last batch",
            _ms(st["last_batch_age_ms"]) + " ago"
            if st["last_batch_age_ms"] is not None
            else "none yet",
        ),
        ("batches", f"{c.get('batches', 0):,}"),
    ]
    audit = st.get("audit")
    if audit is None:
        rows += [
            ("events in", f"{c.get('events_in', 0):,}"),
            ("  aggregated", f"{c.get('events_aggregated', 0):,}"),
            ("  dead-lettered", f"{c.get('dead_letters', 0):,}"),
        ]
    else:
        b = audit["books"]
        verdict = "off"
        if audit["enabled"]:
            verdict = f"{audit['batches_ok']:,} batches complete"
            if audit["failed_attempts"]:
                verdict += f", {audit['failed_attempts']:,} failed attempts replayed"
        rows += [
            ("audit", verdict),
            ("events admitted", f"{b['events_admitted']:,}"),
            (
                "events in",
                f"{b['events_in']:,}  {'= ' if b['balanced'] else '!= '}"
                "aggregated + dead-lettered + expired",
            ),
            ("  aggregated", f"{b['aggregated']:,}"),
            ("  dead-lettered", f"{b['dead_lettered']:,}"),
        ]
        rows += [
            (f"    {reason}", f"{n:,}")
            for reason, n in sorted(b["dead_by_reason"].items())
            if reason != "expired"
        ]
        rows.append(("  expired", f"{b['expired']:,}"))
    width = max(len(k) for k, _ in rows)
    out = [f"{k.ljust(width)}  {v}" for k, v in rows]
    flow = st.get("flow")
    if flow:
        out += ["", *format_flow(flow)]
    return "\n".join(out)


def format_flow(flow: dict[str, Any]) -> list[str]:
    """One row per stage: throttle state, rates and backpressure ratio; then recent changes."""
    head = ("stage", "tasks", "state", "rate/s", "origin/s", "measured/s", "bp ratio", "queue")
    rows = [head]
    for name, s in flow["stages"].items():
        q = s.get("queue") or {}
        queue = "-"
        if "write_ms" in q:
            queue = f"write {_ms(q.get('write_ms'))}, mem {_size(q.get('used_memory'))}"
        elif q:
            queue = f"{q.get('entries', 0):,} entries, {_size(q.get('bytes'))}"
        state = "overloaded" if s["overloaded"] else "ok"
        if s["backpressure"]:
            state = "throttled" + (", overloaded" if s["overloaded"] else "")
        rows.append(
            (
                name,
                str(s["tasks"]),
                state,
                "unlimited" if s["rate"] is None else f"{s['rate']:,.0f}",
                "-" if s["origin_rate"] is None else f"{s['origin_rate']:,.0f}",
                f"{s['measured_rate']:,.0f}",
                f"{s['backpressure_ratio']:.2f}",
                queue,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"backpressure: {flow['controller']}, high {_size(flow['high_watermark'])},"
        f" low {_size(flow['low_watermark'])}"
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    changes = flow.get("timeline") or []
    if changes:
        lines += ["", "recent changes (newest first):"]
        for ev in changes[:5]:
            rate = ev.get("rate")
            lines.append(
                f"  {_clock(ev.get('changed_ms'))}  {ev.get('task')}  "
                f"{'throttled' if ev.get('backpressure') else 'free'}  "
                f"rate {'unlimited' if rate is None else f'{rate:,.0f}/s'}"
            )
    return lines


def _size(n: Any) -> str:
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if v < 1000 or unit == "GB":
            return f"{v:,.0f} {unit}" if unit == "B" else f"{v:,.1f} {unit}"
        v /= 1000
    return f"{v:,.1f} GB"


def _clock(ms: Any) -> str:
    import datetime as dt

    if ms is None:
        return "--:--:--"
    return dt.datetime.fromtimestamp(int(ms) / 1000, dt.UTC).strftime("%H:%M:%S")


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f} ms"


@main.command()
@click.option("--duration", type=float, default=None, help="stop after this many seconds")
@click.option("--rate", type=float, default=2000.0, help="base event rate (bursts are 10x)")
@click.option("--port", type=int, default=8000, help="API port (0 = any free port)")
@click.option("--state-dir", type=click.Path(file_okay=False), default=".sluice/demo")
def demo(duration: float | None, rate: float, port: int, state_dir: str) -> None:
    """Everything embedded: Redis, the Spark pipeline, the API and bursty synthetic load."""
    from sluice.demo import run_demo

    try:
        run_demo(Path(state_dir), duration, rate, port)
    except SluiceError as e:
        raise _fail(e) from None


@main.command("dead-letters")
@config_option
@click.option(
    "--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="how many"
)
@click.option("--reason", default=None, help="only this reason, e.g. bad_json")
@click.option("--json", "as_json", is_flag=True, help="JSON lines on stdout, totals on stderr")
def dead_letters(config_path: str, limit: int, reason: str | None, as_json: bool) -> None:
    """Show the newest dead letters (newest first), their total and the count per reason."""
    from sluice.pipeline.dead_letters import parse_reason, read_dead_letters
    from sluice.redis.connection import open_redis

    cfg = _load(config_path)
    try:
        reason = parse_reason(reason)
        with open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability) as handle:
            out = read_dead_letters(handle.client, cfg, limit, reason)
    except SluiceError as e:
        raise _fail(e) from None
    summary = format_dead_summary(out, cfg.source.dead_letter_stream, reason)
    if as_json:
        for item in out["items"]:
            click.echo(json.dumps(item, ensure_ascii=False))
        click.echo(summary, err=True)
        return
    click.echo(summary)
    if out["items"]:
        import shutil

        click.echo(format_dead_letters(out["items"], shutil.get_terminal_size((120, 24)).columns))


def format_dead_summary(out: dict[str, Any], stream: str, reason: str | None) -> str:
    by = ", ".join(f"{r} {n:,}" for r, n in out["by_reason"].items())
    counted = f"\ncounted since the start, by reason: {by}" if by else ""
    which = f" with reason `{reason}`" if reason else ""
    if not out["items"]:
        return f"no dead letters{which} in {stream} ({out['total']:,} in all){counted}"
    return (
        f"{out['total']:,} dead letters in {stream}; the newest {len(out['items']):,}{which},"
        f" newest first{counted}"
    )


def format_dead_letters(items: list[dict[str, Any]], width: int = 120) -> str:
    """One line per dead letter; `raw` (control characters escaped) is cut to fit `width`."""
    import datetime as dt

    head = ("time (UTC)", "entry id", "idx", "reason", "field", "raw")
    rows = [head]
    for it in items:
        when = dt.datetime.fromtimestamp(it["written_ms"] / 1000, dt.UTC)
        raw = json.dumps(it["raw"], ensure_ascii=False)[1:-1]
        rows.append(
            (
                when.strftime("%Y-%m-%d %H:%M:%S"),
                it["entry_id"],
                str(it["idx"]),
                it["reason"],
                it["field"] or "-",
                raw,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    room = max(20, width - sum(widths) - 2 * len(widths))
    lines = []
    for r in rows:
        raw = r[-1] if len(r[-1]) <= room else r[-1][: room - 1] + "…"
        lines.append("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), raw]))
    return "\n".join(line.rstrip() for line in lines)


if __name__ == "__main__":  # pragma: no cover
    main()
