"""The docs' plots, drawn from a result file's `series`; nothing is drawn without them."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PNG = {"throughput": "throughput.png", "query": "query_latency.png", "burst": "burst.png",
       "audit": "audit_recovery.png", "branches": "branches.png",
       "ingest": "ingest_fields.png", "freshness": "freshness_breakdown.png",
       "soak": "soak_rss.png"}  # fmt: skip
# Benchmarks drawn as one figure per part: name -> {png: what the figure function gets}.
PARTS = {"ingest": {"ingest_fields.png": "fields", "ingest_jsonl.png": "jsonl"}}


def draw(doc: dict[str, Any], out: Path) -> str | None:
    """Draw `doc`'s plot into `out` if its series are there; the PNG's name, else None."""
    name, series = doc["benchmark"], doc.get("series")
    if not series or name not in PNG:
        return None
    parts = PARTS.get(name, {PNG[name]: series})
    for png, arg in parts.items():
        _save(globals()[name](doc, arg), out / png)
    return PNG[name]


def _save(fig: Any, path: Path) -> None:
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _per_batch(rows: list[list[int]], t0_ms: int) -> tuple[list[float], list[float]]:
    """(end s since t0, events/s over the batch's own duration) of [batch, events, start, done]."""
    rows = sorted(rows)
    return [(r[3] - t0_ms) / 1000 for r in rows], [r[1] / max(r[3] - r[2], 1) * 1000 for r in rows]


def throughput(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """Per source: per-batch events/s of the drain and the bare engine (left); the sustained
    steps and the freshness load, with each batch's events/s and the backlog (right)."""
    fmts = series["sources"]
    fig, axes = plt.subplots(len(fmts), 2, figsize=(13, 4.2 * len(fmts)), squeeze=False)
    for (left, right), s, r in zip(axes, fmts, doc["results"]["sources"], strict=True):
        for label, rows in (("pipeline drain", s.get("drain")), ("bare engine", s.get("bare"))):
            if rows:
                left.plot(*_per_batch(rows, min(x[2] for x in rows)), marker="o", label=label)
        left.set(
            title=f"{r['source']}: per-batch events/s (batch {r['batch_events']:,})",
            xlabel="s since the first batch started",
            ylabel="events/s within a batch",
        )
        t0_ms = s.get("t0_ms", 0)
        steps = [x for x in s.get("sustained", []) if x[3] >= t0_ms]  # not the drain's batches
        right.plot(*_per_batch(steps, t0_ms), ".", label="batches")
        for t0, t1, rate, bounded in s["spans"]:
            color = {True: "tab:green", False: "tab:red", None: "tab:purple"}[bounded]
            right.hlines(rate, t0, t1, colors=color, linewidth=2.5)
            right.axvspan(t0, t1, color=color, alpha=0.07)
        right.set(
            title=f"{r['source']}: steps (green bounded, red not), then the freshness load",
            xlabel="s since the first step",
            ylabel="events/s",
        )
        if s["samples"]:
            twin = right.twinx()
            twin.plot(*zip(*sorted(s["samples"]), strict=True), color="tab:orange", lw=1)
            twin.set_ylabel("backlog (events)", color="tab:orange")
    return fig


def query(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """Latency percentiles of each scenario's median run, against the p99 target."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pct in series["latency_pct_ms"].items():
        qs = sorted(pct, key=float)
        ax.plot([pct[q] for q in qs], [float(q) for q in qs], marker="o", label=name)
    ax.axvline(16.0, color="grey", linestyle="--", label="target p99 16 ms")
    ax.set(xscale="log", xlabel="latency (ms, log scale)", ylabel="percentile",
           title="sluice serve: request latency (median run per scenario)")  # fmt: skip
    return fig


def burst(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """Per controller: backlog bytes and Redis memory (left); offered, acked and admitted
    events/s with the Spark controller's rate (right)."""
    runs, p = series["controllers"], doc["params"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for (left, right), s, r in zip(axes, runs, doc["results"]["controllers"], strict=True):
        t, _, exact, gate, used, spark_rate = list(zip(*s["samples"], strict=True))[:6]
        for ys, kw in ((exact, {"label": "backlog"}),
                       (gate, {"lw": 0.6, "ls": ":", "label": "as the gate sees it"}),
                       (used, {"color": "tab:gray", "label": "Redis used_memory"})):  # fmt: skip
            left.plot(t, [y / 1e6 for y in ys], **{"color": "tab:orange", **kw})
        left.axhline(p["hw"] / 1e6, color="tab:red", ls="--", lw=1, label="high watermark")
        left.axhline(p["maxmemory"] / 1e6, color="black", ls=":", lw=1, label="maxmemory")
        if (lifted := s["lifted_at_s"]) is not None:
            left.axvline(lifted, color="black", lw=1, label="settling: none, no maxmemory")
        pr = s["profile"]
        b0, lo, hi = pr["before_s"], pr["low_per_s"], pr["high_per_s"]
        b1 = b0 + pr["burst_s"]
        end = b1 + pr["after_s"]
        right.plot([0, b0, b0, b1, b1, end], [lo, lo, hi, hi, lo, lo], "tab:red", label="offered")
        acked = [
            max((x[2] for x in s["producer"] if x[0] < k), default=0) for k in range(int(end) + 1)
        ]
        per_s = [b - a for a, b in itertools.pairwise(acked)]
        right.step(range(1, len(acked)), per_s, color="tab:green", lw=0.9, label="acked by Redis")
        admitted = s["admitted"]
        right.step(range(1, len(admitted) + 1), admitted, color="tab:blue",
                   label="admitted by Spark")  # fmt: skip
        if lim := [(x, y) for x, y in zip(t, spark_rate, strict=True) if y is not None]:
            right.plot(*zip(*lim, strict=True), color="tab:purple", ls=":", label="Spark rate")
        right.set_ylim(0, hi * 1.3)
        for ax, what in ((left, "input backlog, MB"), (right, "events/s")):
            ax.axvspan(b0, b1, color="tab:red", alpha=0.06)
            ax.set(title=f"{r['controller']}: {what}", xlabel="s since the profile started")
    return fig


def audit(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """The recovery run's backlog with the kills and each start's first batch (above); each
    batch's events, the throttled Spark admission and `audit_ms` (below)."""
    s, t0 = series["recovery"], series["recovery"]["t0_ms"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, height_ratios=[2, 1])
    ax.plot(*_secs(s["samples"], t0), color="tab:orange", lw=1, label="backlog")
    for key, style in (("kills_ms", {"color": "tab:red", "lw": 1.5}),
                       ("first_done_ms", {"color": "tab:green", "ls": "--", "lw": 1}),
                       ("back_ms", {"color": "tab:blue", "ls": ":", "lw": 1})):  # fmt: skip
        for i, ms in enumerate(x for x in s[key] if x is not None):
            ax.axvline((ms - t0) / 1000, label=key.removesuffix("_ms") if i == 0 else None, **style)
    ax.set(ylabel="backlog (events)", title=f"sluice run, SIGKILLed {len(s['kills_ms'])} times")
    ax2.plot(*_secs(s["records"], t0), ".", ms=4, label="events per batch")
    if s["pressed"]:
        xs, rates = _secs(s["pressed"], t0)
        label = "Spark admission under backpressure: rate x trigger"
        ax2.plot(xs, [r * s["trigger_s"] for r in rates], "x", color="tab:red", label=label)
    if audited := [[r[0], r[2]] for r in s["records"] if r[2] is not None]:
        twin = ax2.twinx()
        twin.plot(*_secs(audited, t0), "_", color="tab:purple")
        twin.set_ylabel("audit_ms (dashes)", color="tab:purple")
    ax2.set(xlabel="s since the producer started", ylabel="events")
    return fig


def _secs(rows: list[list[Any]], t0_ms: int) -> tuple[list[float], list[Any]]:
    """([s since t0 of each row's first field], [each row's second field])."""
    return [(r[0] - t0_ms) / 1000 for r in rows], [r[1] for r in rows]


def branches(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """Per propagation mode: each branch's latency (above) and events folded/s (below)."""
    fig, axes = plt.subplots(2, len(series), figsize=(11, 6), sharex=True, squeeze=False)
    for col, (mode, s) in enumerate(series.items()):
        t = s["t"]
        for b, colour in zip(s["latency"], ("tab:red", "tab:blue"), strict=False):
            axes[0][col].plot(t, s["latency"][b], label=f"{b} branch", color=colour)
            f = s["folded"][b]
            rates = [0.0] + [(f[i] - f[i - 1]) / (t[i] - t[i - 1]) for i in range(1, len(t))]
            smooth = [statistics.mean(rates[max(0, i - 5) : i + 1]) for i in range(len(rates))]
            axes[1][col].plot(t, smooth, label=f"{b} branch", color=colour)
        for ax in axes[:, col]:
            ax.axvspan(*s["slow"], color="0.9", label="left store slowed")
        axes[0][col].set(title=f"propagation: {mode}", ylabel="latency, s (event due → folded)")
        axes[1][col].set(ylabel="events folded / s (3 s mean)",
                         xlabel="s since the producer started")  # fmt: skip
    return fig


INGEST_PARTS = {"plan": "plan", "read_redis": "read (Redis)", "spark_tasks": "Spark tasks",
                "wait": "wait for the previous write (written behind)",
                "write_python": "write: Python", "write_lua": "write: Lua", "commit": "commit",
                "other": "other"}  # fmt: skip
INGEST_CORES = {"redis": "Redis", "jvm": "JVM", "python_workers": "Python workers",
                "driver": "driver", "other": "rest of the machine"}  # fmt: skip


def ingest(doc: dict[str, Any], fmt: str) -> Any:
    """One format: per workload and revision, ms per drain batch stacked by part (left), and
    cores stacked by component (right)."""
    rows = [x for x in doc["results"]["rows"] if x["format"] == fmt]
    labels = [f"{x['workload']}\n{x['revision']}" for x in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, parts, key, unit in ((left, INGEST_PARTS, "breakdown", "ms per batch"),
                                 (right, INGEST_CORES, "cores", "cores")):  # fmt: skip
        bottom = [0.0] * len(rows)
        for part, label in parts.items():
            vals = [(x.get(key) or {}).get(part) or 0.0 for x in rows]
            ax.bar(labels, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set(title=f"`{fmt}`: {unit} (medians over the rounds)", ylabel=unit)
        ax.set_ylim(0, max(bottom, default=1.0) * 1.5)  # room for the legend above the bars
    return fig


def freshness(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """Median ms per batch at each steady rate, before and after side by side, by phase."""
    rows = [x for x in doc["results"]["rows"] if x["breakdown"]]
    labels = [f"{x['format']} {x['rate'] // 1000}k\n{x['revision']}" for x in rows]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    bottom = [0.0] * len(rows)
    for i, phase in enumerate(doc["results"]["phases"]):  # 12 phases: tab20, not 10 colours
        vals = [x["breakdown"]["phases_ms"].get(phase) or 0.0 for x in rows]
        ax.bar(labels, vals, bottom=bottom, label=phase, color=plt.get_cmap("tab20")(i))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(title="ms per batch by phase (medians over the measured batches and rounds)",
           ylabel="ms per batch")  # fmt: skip
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylim(0, max(bottom, default=1.0) * 1.6)  # room for the legend above the bars
    return fig


def soak(doc: dict[str, Any], series: dict[str, Any]) -> Any:
    """Per process: RSS of its whole process group (top), and its threads (bottom), over the
    soak, with Redis's used_memory and the faults marked."""
    t0 = series["t0_ms"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for name in dict.fromkeys(r[1] for r in series["procs"]):
        rows = [r for r in series["procs"] if r[1] == name]
        t = [(r[0] - t0) / 60_000 for r in rows]
        top.plot(t, [r[2] for r in rows], lw=1, label=name)
        bottom.plot(t, [r[6] for r in rows], lw=1, label=name)
    if mem := [r for r in series["redis"] if r[1] is not None]:
        top.plot([(r[0] - t0) / 60_000 for r in mem], [r[1] for r in mem], "k:", lw=1,
                 label="Redis used_memory")  # fmt: skip
    for at_s, kind in series["faults"]:
        for ax in (top, bottom):
            ax.axvline(at_s / 60, color="tab:red" if "kill" in kind else "tab:purple", lw=0.8,
                       ls="--")  # fmt: skip
    top.set(title="soak: RSS per process group (red: kill -9 of the leader; purple: Redis "
            "restart)", ylabel="MB")  # fmt: skip
    bottom.set(title="threads per process group", xlabel="minutes since the first standby was warm",
               ylabel="threads")  # fmt: skip
    return fig
