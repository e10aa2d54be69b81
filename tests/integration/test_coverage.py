"""How far back each metric's stored history reaches (`status.coverage`), as `sluice status`,
`/v1/status` and `sluice run`'s start show it: a metric added to a running deployment says its
history is short until a backfill writes it."""

from __future__ import annotations

from pathlib import Path

import redis
from fastapi.testclient import TestClient

from sluice.clock import ManualClock
from sluice.config import Config, config_from_dict
from sluice.redis.keys import FOLDING_KEY, SEAMS_KEY, STARTS_KEY
from sluice.server.app import create_app
from sluice.status.coverage import metric_history, new_metric_notes
from sluice.status.views import format_status

H = 3_600_000
D = 24 * H
NOW = 1_000 * D + 30 * 60_000  # 1972-09-27T00:30:00Z


def _config(tmp_path: Path) -> Config:
    metric = {"key": ["card"], "agg": "count", "slice": "1m", "retention": "7d"}
    return config_from_dict({
        "state_dir": str(tmp_path),
        "source": {"schema": {"ts": "long", "card": "string"}, "time_field": "ts"},
        "metrics": [{**metric, "name": n} for n in ("live_only", "backfilled", "added", "old")],
    })  # fmt: skip


def test_each_metrics_history_is_what_the_live_fold_and_backfills_wrote(
    r: redis.Redis, tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    assert new_metric_notes(r, cfg) == []  # a new deployment: nothing to say
    # `live_only`: folded live for the last 2 h, never backfilled. `backfilled`: a backfill over
    # the whole archive with its seam after the live fold began. `old`: folded live for 8 days.
    # `added`: in the config, written by nothing yet.
    began = NOW - 2 * H - 20_000
    r.hset(FOLDING_KEY, mapping={"live_only": began, "backfilled": began, "old": NOW - 8 * D})
    r.hset(SEAMS_KEY, "backfilled", NOW - H)
    r.hset(STARTS_KEY, "backfilled", 0)
    history = metric_history(r, cfg, NOW)
    live_from = began + 20_000  # the first whole minute after it began
    assert history["live_only"] == {
        "complete_from_ms": live_from, "live_from_ms": live_from, "backfilled_until_ms": None,
        "missing_ms": 7 * D - 2 * H, "retention_ms": 7 * D,
    }  # fmt: skip
    assert history["backfilled"]["complete_from_ms"] == 0
    assert history["backfilled"]["missing_ms"] == 0
    assert history["old"]["missing_ms"] == 0
    assert history["added"] == {
        "complete_from_ms": None, "live_from_ms": None, "backfilled_until_ms": None,
        "missing_ms": 7 * D, "retention_ms": 7 * D,
    }  # fmt: skip
    # A backfill whose seam came before the live fold began leaves a gap: live history only.
    r.hset(SEAMS_KEY, "backfilled", began - H)
    assert metric_history(r, cfg, NOW)["backfilled"]["complete_from_ms"] == live_from

    (note,) = new_metric_notes(r, cfg)
    assert note.startswith("metric 'added' is new to this store") and "retention is 1w" in note
    assert "`sluice backfill --metrics added --input <archive>`" in note

    api = TestClient(create_app(cfg, r, clock=ManualClock(NOW)))
    status = api.get("/v1/status").json()
    assert status["coverage"]["live_only"]["missing_ms"] == 7 * D - 2 * H
    scrape = api.get("/metrics").text
    assert 'sluice_metric_history_missing_seconds{metric="live_only"} 597600.0' in scrape
    assert 'sluice_metric_history_missing_seconds{metric="old"} 0.0' in scrape
    lines = format_status(status).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("history "))
    assert lines[at].split(None, 1)[1].strip() == (
        "3 of 4 metrics hold less than their retention; `sluice backfill` writes what came before"
    )
    rows = {line.split()[0]: line.split(None, 1)[1].strip() for line in lines[at + 1 : at + 4]}
    assert rows == {
        "live_only": "2 h 00 min of its 1w retention, from 1972-09-26 22:30 UTC (no backfill)",
        "backfilled": "2 h 00 min of its 1w retention, from 1972-09-26 22:30 UTC",
        "added": "nothing of its 1w retention: not folded live yet (no backfill)",
    }


def test_status_says_when_every_metric_holds_its_whole_retention(
    r: redis.Redis, tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    names = ("live_only", "backfilled", "added", "old")
    r.hset(FOLDING_KEY, mapping=dict.fromkeys(names, NOW - 8 * D))
    status = TestClient(create_app(cfg, r, clock=ManualClock(NOW))).get("/v1/status").json()
    (line,) = [x for x in format_status(status).splitlines() if x.startswith("history ")]
    assert line.split(None, 1)[1].strip() == "complete over every metric's retention"
    assert new_metric_notes(r, cfg) == []
