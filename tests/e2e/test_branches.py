"""Seed 000's hop-by-hop backpressure on a branched graph, against Heron-style source
throttling: when one branch is slowed, hop by hop only its own chain throttles and the other
branch keeps its rate; throttling the source slows both (see tests/e2e/branches.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.branches import run_experiment

RATE = 600.0
# Small branch streams (100 KB high watermark) fill within seconds, so a short slowdown shows
# the whole chain; bench/branches.py runs the long version.
RUN: dict[str, Any] = {"warm_s": 8.0, "slow_s": 20.0, "tail_s": 0.0, "stream_hw": 100_000}


def test_a_slow_branch_throttles_its_own_chain_only(
    redis_url: str, spark: Any, tmp_path: Path
) -> None:
    hop = run_experiment(redis_url, spark, tmp_path / "hop", "hop", rate=RATE, **RUN)
    s = hop.summary()
    # the slow store throttled its fold, whose stream then throttled the `left` stage ...
    assert {"fold:left", "left"} <= set(s["flagged"]), s
    # ... and nothing before the branch point: the producer kept its schedule
    assert "ingest" not in s["flagged"] and "right" not in s["flagged"], s
    assert s["right"]["rate_slow"] >= 0.85 * RATE, s
    assert s["right"]["latency_p50_s"] < s["left"]["latency_p50_s"], s

    heron = run_experiment(redis_url, spark, tmp_path / "source", "source", rate=RATE, **RUN)
    h = heron.summary()
    # the same overloads go to the ingest tasks: the producer is held back for both branches
    assert "ingest" in h["flagged"], h
    assert not {"left", "right", "fold:left"} & set(h["flagged"]), h
    assert h["right"]["rate_slow"] < 0.9 * RATE, h
    assert h["right"]["rate_slow"] < s["right"]["rate_slow"], (h, s)
