"""Write docs/benchmarks.md and the plots from the result files in bench/results/.

    .venv/bin/python bench/render.py                         # full results, else quick ones
    .venv/bin/python bench/render.py --quick --out /tmp/docs  # quick ones first, elsewhere

A section per benchmark from its template in bench/templates/ (the prose lives there only). A
plot is drawn only when its result holds the series it needs; otherwise the PNG in docs/ stays.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import jinja2

from lib import offline_plots, plots
from lib.results import RESULTS_DIR, ROOT

# The sections in order: the template's name, then the result files (the first one is the
# section's run, any others follow it). A template's first line is its `## ` heading.
# The ingest and store sections each follow the other's run: the ingest findings quote the bound
# the store puts on a drain, the store's section the store's rate in the pipeline and its
# instruction counts (a `bench/store.py --callgrind` run).
SECTIONS = [["throughput"], ["ingest", "ingest-bare-audit", "ingest-bare-audit.cells",
                             "ingest-bare-slots.cells", "ingest-bare-partial",
                             "ingest-partial-sweep", "ingest-partial", "ingest-partial.midcard",
                             "ingest-audit",
                             "ingest-audit.cells", "ingest-audit.highcard",
                             "ingest-audit.highcard-fields", "ingest-cap", "ingest-cap.cells",
                             "store"],
            ["store", "ingest", "store-instructions", "store-servers", "store-replication",
             "store-layout"],
            ["state_fold"],
            ["collector"],
            ["query", "query-transports"], ["durability"],
            ["burst", "burst-stepwise"], ["audit"], ["cluster"], ["spark_cluster"], ["branches"],
            ["failover", "failover-six", "failover-highcard", "failover-warming",
             "failover-warming-before"], ["jvm_start"],
            ["freshness", "freshness-highcard"],
            ["offline", "offline-backfill", "offline-backfill-conf", "offline-backfill-rerun",
             "offline-training",
             "offline-training-zipf", "offline-stages", "offline-minmax"],
            ["training-windows"],
            ["soak"]]  # fmt: skip
ALSO = {"durability": (ROOT / "docs" / "durability.md", "## Measured (bench/durability.py)")}


def n(v: Any, spec: str = ",.0f", none: str = "–") -> str:
    """`v` formatted with `spec`; `none` for a missing value."""
    return none if v is None or isinstance(v, jinja2.Undefined) else format(v, spec)


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROOT / "bench" / "templates"), autoescape=False,
        # A run cut short leaves values out; they print as missing ("–"), not as an error.
        undefined=jinja2.ChainableUndefined, trim_blocks=True, lstrip_blocks=True,
    )  # fmt: skip
    env.filters |= {
        "n": n, "pct": lambda v, spec=".0%": n(v, spec),
        "yes": lambda v, no="**no**": "yes" if v else no,
        "oneline": lambda text: " ".join(text.split()),  # a paragraph written over several lines
        "mb": lambda b: n(None if b is None else b / 1e6, ".1f") + " MB",
        "times": lambda k: "1 time" if k == 1 else f"{n(k)} times",
        # a latency in milliseconds up to 10 s, in seconds above
        "dur_ms": lambda v: n(v) + " ms" if v is None or v < 10_000 else n(v / 1000, ".1f") + " s",
        "ms": lambda v: n(v, ",.1f" if v is not None and v < 100 else ",.0f"),  # wrk's latencies
    }  # fmt: skip
    return env


def candidates(name: str, quick: bool) -> list[Path]:
    """The result files of `name` that exist: the full run first, then the quick one (with
    `quick`, the other way)."""
    full, smoke = RESULTS_DIR / f"{name}.json", RESULTS_DIR / f"{name}.quick.json"
    return [p for p in ((smoke, full) if quick else (full, smoke)) if p.exists()]


def render(env: jinja2.Environment, out: Path, quick: bool) -> str:
    """The whole docs/benchmarks.md; draws each plot whose series are present."""
    parts = [env.get_template("header.md").render().strip() + "\n"]
    for names in SECTIONS:
        tried: list[str] = []
        for path in candidates(names[0], quick):
            try:
                text = section(env, out, names, json.loads(path.read_text()))
                break
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
                # a result file older than its template (its series renamed since)
                tried.append(f"{path.relative_to(ROOT)}: {e!r}")
                print(f"skipped {path.relative_to(ROOT)}: it does not fit its template"
                      f" ({e!r}); run the benchmark again")  # fmt: skip
        else:
            if tried:
                raise SystemExit(f"no result of {names[0]} fits its template: {'; '.join(tried)}")
            continue
        parts.append(text + "\n")
        if names[0] in ALSO:
            replace_section(out / ALSO[names[0]][0].name, ALSO[names[0]][1], text.split("\n", 1)[1])
    return "\n".join(parts)


def section(env: jinja2.Environment, out: Path, names: list[str], main: dict[str, Any]) -> str:
    """One benchmark's section from its run `main`, followed by the runs of the section's other
    result files that are of the same kind (a full run is not followed by quick ones)."""
    kind = main["run"]["quick"]
    follow = [d for d in (pick(x, kind) for x in names[1:]) if d and d["run"]["quick"] == kind]
    png = plots.draw(main, out) or plots.PNG.get(names[0])
    if names[0] == "offline":  # its parts may come from separate runs (`--part`)
        png = offline_plots.draw([main, *follow], out)
    text = env.get_template(f"{names[0]}.md").render(
        doc=main, run=main["run"], p=main["params"], r=main["results"], follow=follow, png=png
    )
    return re.sub(r"\n{3,}", "\n\n", text).strip()  # blank lines the templates' logic left


def pick(name: str, quick: bool) -> dict[str, Any] | None:
    """The result of `name`: the full run, else the quick one (with `quick`, the other way)."""
    found = candidates(name, quick)
    return json.loads(found[0].read_text()) if found else None


def replace_section(path: Path, heading: str, body: str) -> None:
    """Replace the `## ` section `heading` of markdown file `path` (up to the next `## `) with
    `body`, or append it. Copies the file from docs/ first when writing elsewhere."""
    src = path if path.exists() else ROOT / "docs" / path.name
    lines = src.read_text().splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), len(lines))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    after = "".join(lines[end:])
    section = f"{heading}\n\n{body.strip()}\n"
    path.write_text(
        "".join(lines[:start]).rstrip("\n") + "\n\n" + section + ("\n" + after if after else "")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="prefer quick results over full ones")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="where the docs go")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks.md").write_text(render(environment(), args.out, args.quick))
    print(f"wrote {args.out / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
