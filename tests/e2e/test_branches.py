"""Seed 000's hop-by-hop backpressure on a branched graph, against Heron-style source
throttling: when one branch is slowed, hop by hop only its own chain throttles and the other
branch keeps getting the full input; throttling the source holds the input back for both (see
sluice/testing/branches.py). The assertions are about who throttles and whether the producer kept
its schedule, not about rates or latencies, which a shared 2-core machine makes too noisy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.testing.branches import run_experiment

RATE = 300.0  # low enough that a loaded 2-core machine still keeps up with it
ON_SCHEDULE_S = 1.5  # a producer behind by less has kept its schedule (one flush of slack)
# Small branch streams (60 KB high watermark) fill within seconds, so a short slowdown shows
# the whole chain; bench/branches.py runs the long version.
RUN: dict[str, Any] = {
    "warm_s": 8.0, "slow_s": 25.0, "tail_s": 0.0, "stream_hw": 60_000, "slow_write_ms": 15_000.0
}  # fmt: skip


def test_a_slow_branch_throttles_its_own_chain_only(
    redis_url: str, spark: Any, tmp_path: Path
) -> None:
    hop = run_experiment(redis_url, spark, tmp_path / "hop", "hop", rate=RATE, **RUN)
    s = hop.summary()
    # the slow store throttled its fold, whose stream then throttled the `left` stage ...
    assert {"fold:left", "left"} <= set(s["flagged"]), s
    # ... and nothing before the branch point: the producer kept its schedule (one flush of
    # slack), so the right branch got every event on time, and folded more than the left
    assert "ingest" not in s["flagged"], s
    assert s["producer_behind_max_s"] < ON_SCHEDULE_S, s
    assert s["right"]["rate_slow"] > s["left"]["rate_slow"], s

    heron = run_experiment(redis_url, spark, tmp_path / "source", "source", rate=RATE, **RUN)
    h = heron.summary()
    # the same overloads go to the ingest tasks: the producer is held back, for both branches
    # (by how much depends on how fast the pipeline drains; it is off schedule, and further
    # behind than with hop-by-hop backpressure)
    assert "ingest" in h["flagged"], h
    assert not {"left", "right", "fold:left"} & set(h["flagged"]), h
    assert h["producer_behind_max_s"] > ON_SCHEDULE_S, h
    assert h["producer_behind_max_s"] > s["producer_behind_max_s"], (h, s)
    # per-branch latency of both runs, for the log (bench/branches.py measures it properly)
    print({"hop": s, "source": h})
