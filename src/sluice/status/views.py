"""Terminal views of the pipeline's state: the `sluice status` table and the dead-letter list.

Pure functions from the JSON of `pipeline.status.read_status` and
`pipeline.dead_letters.read_dead_letters` to text, so the CLI, tests and scripts share them.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sluice.status.consistency import RESULTS
from sluice.units import duration_text, format_duration_ms


def format_status(st: dict[str, Any]) -> str:
    c = st["counters"]
    f = st["freshness_ms"]
    pipe = st.get("pipeline") or {"state": "unknown"}
    state = pipe["state"]
    if pipe.get("consecutive_failures"):
        state += f" ({pipe['consecutive_failures']} failures in a row: {pipe.get('last_error')})"
    backlog = st["backlog"]
    entries = backlog.get("entries")
    size = _size(backlog.get("bytes")) + (" (estimated)" if backlog.get("bytes_estimated") else "")
    rows = [
        ("pipeline", state),
        ("log", _log(st.get("log") or {})),
        ("backlog (entries)", "-" if entries is None else f"{entries:,}"),
        ("backlog (bytes)", size),
        ("events/s in / admitted / processed", _rates(st)),
        ("freshness p50 / p99", f"{_ms(f['p50'])} / {_ms(f['p99'])}"),
        (
            "last batch",
            _ms(st["last_batch_age_ms"]) + " ago"
            if st["last_batch_age_ms"] is not None
            else "none yet",
        ),
        ("batches", f"{c.get('batches', 0):,}"),
        ("redis memory", _size((st.get("redis") or {}).get("used_memory"))),
    ]
    if (st.get("redis") or {}).get("state") == "loading":
        rows.insert(0, ("redis", f"LOADING its dataset; waiting: {st['redis'].get('message')}"))
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
        ]
        if b.get("events_removed"):
            rows.append(("  removed before read", f"{b['events_removed']:,} (left the log after"
                         " their batch was planned: an XDEL, a failover's loss)"))  # fmt: skip
        rows += [
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
    rows += _consistency(st.get("consistency"))
    rows += _history(st.get("coverage") or {})
    rows.append(("batch time (median)", _timing(st.get("timing") or {})))
    rows += _processes(st.get("roles") or {})
    width = max(len(k) for k, _ in rows)
    out = [f"{k.ljust(width)}  {v}" for k, v in rows]
    flow = st.get("flow")
    if flow:
        out += ["", *format_flow(flow)]
    return "\n".join(out)


def _consistency(report: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The newest `sluice consistency` report (see status.consistency): when it ran and how
    many sampled answers matched; with mismatches, the metrics that had them, most first."""
    if report is None:
        return [("consistency", "no report yet (`sluice consistency` makes one)")]
    n = {r: int(report.get(r) or 0) for r in RESULTS}
    text = (
        f"{n['matched']:,} matched, {n['mismatched']:,} mismatched, {n['missing']:,} missing"
        f" of {int(report.get('samples') or 0):,} sampled answers"
    )
    at_ms = report.get("at_ms")
    if isinstance(at_ms, int | float):
        text = f"{dt.datetime.fromtimestamp(at_ms / 1000, dt.UTC):%Y-%m-%d %H:%M} UTC: {text}"
    if n["skipped"]:
        text += f" ({n['skipped']:,} skipped)"
    rows = [("consistency", text)]
    mismatched = {
        name: int(m.get("mismatched") or 0)
        for name, m in (report.get("metrics") or {}).items()
        if isinstance(m, dict)
    }
    bad = sorted((name for name, k in mismatched.items() if k), key=lambda m: -mismatched[m])
    if bad:
        rows.append(("  mismatched in", ", ".join(f"{m} ({mismatched[m]:,})" for m in bad)))
    return rows


def _history(history: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """Each metric whose stored history is shorter than its retention (status.coverage): its
    long windows miss what came before, until `sluice backfill` writes it."""
    short = {name: h for name, h in history.items() if h.get("missing_ms")}
    if not history or not short:
        return [("history", "complete over every metric's retention")] if history else []
    rows = [("history", f"{len(short)} of {len(history)} metrics hold less than their"
                        " retention; `sluice backfill` writes what came before")]  # fmt: skip
    for name, h in short.items():
        held = h["retention_ms"] - h["missing_ms"]
        since = h.get("complete_from_ms")
        text = f"{_span(held)} of its {format_duration_ms(h['retention_ms'])} retention"
        if since is None:
            text += ": not folded live yet"
        else:
            text += f", from {dt.datetime.fromtimestamp(since / 1000, dt.UTC):%Y-%m-%d %H:%M} UTC"
        if h.get("backfilled_until_ms") is None:
            text += " (no backfill)"
        rows.append((f"  {name}", text))
    return rows


def _span(ms: int) -> str:
    return "nothing" if ms <= 0 else duration_text(ms / 1000)


def _timing(timing: dict[str, Any]) -> str:
    """A batch's median time over the last window, and its three largest phases."""
    recent = timing.get("recent") or {}
    if not recent.get("batches"):
        return "no batch lately"
    top = sorted((recent.get("phases_ms") or {}).items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{p} {_ms(v)}" for p, v in top)
    return f"{_ms(recent.get('total_ms'))} over {recent['batches']} batches; most in {parts}"


def _processes(roles: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per `sluice run` process: its role, host, pid and lease age (see status.roles)."""
    procs = roles.get("processes") or []
    if not procs:
        return [("processes", "none running")]
    rows = []
    for i, p in enumerate(procs):
        text = f"{p['role']} on {p['host']}, pid {p['pid']}"
        if p.get("lease_age_ms") is not None:
            text += f", epoch {p.get('epoch')}, lease renewed {_ms(p['lease_age_ms'])} ago"
        elif p["role"] == "standby":
            text += ", warm" if p.get("warm") else ", warming up"
        rows.append(("processes" if i == 0 else "", text))
    return rows


def _log(log: dict[str, Any]) -> str:
    """The source log in one line: which, whether it can be read, and Kafka's lag."""
    if log.get("kind") == "kafka":
        text = f"kafka topic {log.get('topic')} (group {log.get('group_id')})"
        lag = log.get("lag")
        if lag:
            parts = ", ".join(
                f"{p}: {n:,}" for p, n in sorted(lag.items(), key=lambda kv: int(kv[0]))
            )
            text += f"; lag by partition {parts}"
    else:
        text = "redis streams"
    if log.get("state") == "waiting":
        text += f"; WAITING ({log.get('reason')}): {log.get('message')}"
    return text


def _rates(st: dict[str, Any]) -> str:
    r = st.get("rates") or {}
    parts = (r.get("input_events_per_s"), r.get("admitted_events_per_s"))
    shown = [("-" if v is None else f"{v:,.0f}") for v in parts]
    return " / ".join([*shown, f"{st['processed_events_per_s']:,.0f}"])


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
    if ms is None:
        return "--:--:--"
    return dt.datetime.fromtimestamp(int(ms) / 1000, dt.UTC).strftime("%H:%M:%S")


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f} ms"


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


def _visible(text: str) -> str:
    """`text` on one line as it reads: quotes and backslashes as they are, only characters that
    do not print escaped (`\\n`, `\\x1b`, `\\u2028`). `--json` gives the exact text."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_dead_letters(items: list[dict[str, Any]], width: int = 120) -> str:
    """One line per dead letter; `raw` (control characters escaped) is cut to fit `width`."""
    head = ("time (UTC)", "entry id", "idx", "reason", "field", "raw")
    rows = [head]
    for it in items:
        when = dt.datetime.fromtimestamp(it["written_ms"] / 1000, dt.UTC)
        raw = _visible(it["raw"])
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
