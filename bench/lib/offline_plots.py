"""The offline section's plot: training-set rows/s against the range join's, as the window list
grows and as the spine grows, from the newest result that holds the training part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PNG = "offline_training.png"
METHODS = {"training_set": ("training set", "tab:blue"), "range_join": ("range join", "tab:gray")}


def draw(docs: list[dict[str, Any]], out: Path) -> str | None:
    """Draw the plot into `out` if one of `docs` (an offline section's runs) has the training
    part; the PNG's name, else None."""
    have = [
        d for d in docs
        if d["benchmark"] == "offline" and "training" in d["results"]
        and d["results"]["training"]["params"].get("cells", "all") == "all"
    ]  # fmt: skip
    if not have:
        return None
    t = max(have, key=lambda d: d["run"]["date"])["results"]["training"]
    rows, big = t["summary"]["rows"], max(t["params"]["spines"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    by_windows = sorted((x for x in rows if x["spine"] == big), key=lambda x: x["windows"])
    by_spine = sorted((x for x in rows if x["windows"] == 3), key=lambda x: x["spine"])
    for ax, xs, key, label in ((left, by_windows, "windows", "windows per metric (2 metrics)"),
                               (right, by_spine, "spine", "spine rows")):  # fmt: skip
        for method, (name, colour) in METHODS.items():
            pts = [(x[key], x[method]["per_s"]) for x in xs if x[method]["per_s"]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=colour, label=name)
        top = max((x[m]["per_s"] or 0 for x in xs for m in METHODS), default=1.0)
        ax.set(xlabel=label, ylabel="spine rows / s", xscale="log", ylim=(0, top * 1.25))
        ax.set_xticks([x[key] for x in xs], [f"{x[key]:,}" for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    left.set_title(f"{big:,} spine rows, {t['params']['events']:,} events")
    right.set_title(f"3 windows per metric, {t['params']['events']:,} events")
    fig.tight_layout()
    fig.savefig(out / PNG, dpi=90)
    plt.close(fig)
    return PNG
