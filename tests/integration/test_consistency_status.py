"""The newest `sluice consistency` report in the read side, against real Redis: `/v1/status`
and `read_status` carry it as stored (null when there is none), `sluice status` shows it in one
line (and the metrics with mismatches), and `/metrics` exports its counts and time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import yaml
from click.testing import CliRunner
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from sluice.cli import main
from sluice.redis.keys import CONSISTENCY_KEY
from sluice.server.app import create_app
from sluice.status.snapshot import read_status
from sluice.status.views import format_status
from tests.conftest import make_config

AT_MS = 1_795_894_800_000  # 2026-11-28 19:40 UTC

REPORT: dict[str, Any] = {
    "at_ms": AT_MS,
    "input": "archive/events-2026-11-28",
    "samples": 1240,
    "matched": 1230,
    "mismatched": 4,
    "missing": 3,
    "skipped": 3,
    "metrics": {
        "txn_count": {"matched": 1000, "mismatched": 1, "missing": 3, "skipped": 0},
        "amount_sum": {"matched": 230, "mismatched": 3, "missing": 0, "skipped": 3},
        "card_min": {"matched": 0, "mismatched": 0, "missing": 0, "skipped": 0},
    },
    "examples": [
        {"metric": "amount_sum", "key": ["m1"], "window_ms": 60_000, "end_ms": AT_MS - 9,
         "online": 12.5, "offline": 13.0},
    ],
}  # fmt: skip


@pytest.fixture
def api(r: redis.Redis, redis_url: str, tmp_path: Path) -> TestClient:
    return TestClient(create_app(make_config(redis_url, tmp_path), r, history=False))


def _line(text: str, label: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(label)).removeprefix(label).strip()


def test_status_carries_the_report_as_stored(
    r: redis.Redis, api: TestClient, redis_url: str, tmp_path: Path
) -> None:
    assert api.get("/v1/status").json()["consistency"] is None
    r.set(CONSISTENCY_KEY, orjson.dumps(REPORT))
    assert api.get("/v1/status").json()["consistency"] == REPORT
    assert read_status(r, make_config(redis_url, tmp_path), AT_MS)["consistency"] == REPORT
    r.set(CONSISTENCY_KEY, b"{half a report")  # unreadable: shown as none, the status still up
    assert api.get("/v1/status").json()["consistency"] is None


def test_the_status_view_shows_the_report(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path)
    text = format_status(read_status(r, cfg, AT_MS))
    assert _line(text, "consistency") == "no report yet (`sluice consistency` makes one)"
    assert "mismatched in" not in text
    r.set(CONSISTENCY_KEY, orjson.dumps(REPORT))
    text = format_status(read_status(r, cfg, AT_MS))
    assert _line(text, "consistency") == (
        "2026-11-28 19:40 UTC: 1,230 matched, 4 mismatched, 3 missing of 1,240 sampled answers"
        " (3 skipped)"
    )
    assert _line(text, "  mismatched in") == "amount_sum (3), txn_count (1)"
    metrics = {"txn_count": {"matched": 1234, "mismatched": 0, "missing": 3, "skipped": 0}}
    clean = {**REPORT, "matched": 1234, "mismatched": 0, "skipped": 0, "samples": 1237,
             "metrics": metrics}  # fmt: skip
    r.set(CONSISTENCY_KEY, orjson.dumps(clean))
    text = format_status(read_status(r, cfg, AT_MS))
    assert _line(text, "consistency") == (
        "2026-11-28 19:40 UTC: 1,234 matched, 0 mismatched, 3 missing of 1,237 sampled answers"
    )
    assert "mismatched in" not in text


def test_prometheus_exports_the_report(r: redis.Redis, api: TestClient) -> None:
    def families() -> dict[str, Any]:
        return {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}

    assert "sluice_consistency_answers" not in families()
    r.set(CONSISTENCY_KEY, orjson.dumps(REPORT))
    fams = families()
    answers = {s.labels["result"]: s.value for s in fams["sluice_consistency_answers"].samples}
    assert answers == {"matched": 1230, "mismatched": 4, "missing": 3, "skipped": 3}
    (stamp,) = fams["sluice_consistency_report_timestamp_seconds"].samples
    assert stamp.value == AT_MS / 1000


def test_the_status_command_shows_the_report(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(
        {"redis": redis_url, "source": {"schema": {"ts": "long", "card": "string"}},
         "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count"}]}
    ))  # fmt: skip
    status = ["--log-level", "warning", "status", "-c", str(path)]
    out = CliRunner().invoke(main, [*status, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["consistency"] is None
    r.set(CONSISTENCY_KEY, orjson.dumps(REPORT))
    assert json.loads(CliRunner().invoke(main, [*status, "--json"]).output)["consistency"] == REPORT
    text = CliRunner().invoke(main, status).output
    assert "1,230 matched, 4 mismatched, 3 missing of 1,240 sampled answers" in text


def test_a_store_with_no_logged_answer_is_reported_without_spark(r: redis.Redis) -> None:
    """`sluice consistency` asks the store first: with no logged answer it stores an empty
    report (status then says nothing was checked) and starts no Spark; with one, it goes on."""
    from sluice.offline.consistency import nothing_logged
    from sluice.redis.keys import ANSWERS_KEY

    report = nothing_logged(r, "archive/a.parquet")
    assert report is not None and report.samples == 0
    stored = orjson.loads(r.get(CONSISTENCY_KEY) or b"{}")
    assert stored["samples"] == 0 and stored["input"] == "archive/a.parquet"
    r.xadd(ANSWERS_KEY, {"metric": "txn_count"})
    assert nothing_logged(r, "archive/a.parquet") is None
