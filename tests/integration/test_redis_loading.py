"""A real Redis really loading its dataset after a restart (`tests.loading_redis`): the server
answers 503 `redis_loading` (never 500), the status says Redis is loading, the source plans
nothing and its reads wait, the writer waits and writes exactly once; all resume after."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from pyspark.sql.streaming.datasource import ReadAllAvailable

from sluice.pipeline.plan import DEAD_G
from sluice.pipeline.writer import WriterContext, write_partition
from sluice.redis.connection import client_for
from sluice.redis.keys import dead_letter_stream_key
from sluice.server.app import create_app
from sluice.source.waiting import read_log_state
from sluice.status.snapshot import read_status
from sluice.status.views import format_status
from tests.conftest import make_config
from tests.integration.test_api import _seed
from tests.integration.test_source import NOW, _jsonl_entries, _read_all, _reader
from tests.loading_redis import LoadingRedis

LOAD_S = 3.0


@pytest.fixture
def loading(tmp_path: Path) -> Iterator[LoadingRedis]:
    with LoadingRedis(tmp_path / "redis") as server:
        yield server


def test_server_and_status_while_redis_loads(loading: LoadingRedis, tmp_path: Path) -> None:
    now, _ = _seed(loading.client)
    cfg = make_config(loading.url, tmp_path)
    api = TestClient(create_app(cfg, client_for(loading.url), history=False))
    lookup = {"key": "c1", "window": "15s", "end": now}
    assert api.get("/v1/metrics/txn_count", params=lookup).json()["value"] == 5
    loading.restart(LOAD_S)
    resp = api.get("/v1/metrics/txn_count", params=lookup)
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert resp.json()["error"]["code"] == "redis_loading"
    batch = api.post("/v1/query", json={"queries": [{"metric": "txn_count", "key": "c1",
                                                     "window": "15s", "end": now}]})  # fmt: skip
    assert batch.status_code == 503 and batch.json()["error"]["code"] == "redis_loading"
    health = api.get("/healthz")
    assert health.status_code == 503 and health.json()["error"]["code"] == "redis_loading"
    st = api.get("/v1/status")
    assert st.status_code == 200
    body = st.json()
    assert body["redis"]["state"] == "loading"
    assert body["log"]["state"] == "waiting" and body["log"]["reason"] == "loading"
    assert "LOADING" in format_status(read_status(client_for(loading.url), cfg, now))
    loading.wait_loaded()
    assert api.get("/v1/metrics/txn_count", params=lookup).json()["value"] == 5
    assert api.get("/healthz").status_code == 200
    assert api.get("/v1/status").json()["redis"]["state"] == "ok"


def test_source_waits_while_redis_loads_and_resumes(
    loading: LoadingRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(loading.url, tmp_path)
    reader = _reader(cfg, loading.url)
    start = reader.initialOffset()
    for shard in ("events:0", "events:1"):
        _jsonl_entries(loading.client, shard, 5, 100, NOW)
    end = reader.latestOffset(start, ReadAllAvailable())
    loading.restart(2 * LOAD_S)  # the plan's wait takes a few slow round trips
    with caplog.at_level(logging.WARNING):
        assert reader.latestOffset(start, ReadAllAvailable()) is start  # waits: plans nothing
    waiting = [r for r in caplog.records if r.getMessage() == "log unavailable; waiting"]
    assert waiting and waiting[0].__dict__["reason"] == "loading"
    assert loading.loading()
    # A batch planned before the restart reads all its events once Redis has loaded.
    assert _read_all(reader, start, end).num_rows == 1000
    assert not loading.loading()
    assert reader.latestOffset(start, ReadAllAvailable())["ids"] == end["ids"]
    state = read_log_state(loading.client)
    assert state is not None and state["state"] == "ok"


def _dead_rows(records: list[str]) -> Iterator[pa.RecordBatch]:
    """A writer partition holding dead letters only, as the plan hands them to the writer."""
    n = len(records)
    yield pa.RecordBatch.from_pydict(
        {"g": pa.array([DEAD_G] * n, pa.int32()), "k": records, "s": [0] * n, "cnt": [1] * n,
         "min_ems": [NOW] * n, "max_ems": [NOW] * n}
    )  # fmt: skip


def test_writer_waits_while_redis_loads_and_writes_exactly_once(
    loading: LoadingRedis, tmp_path: Path
) -> None:
    cfg = make_config(loading.url, tmp_path)
    ctx = WriterContext(url=loading.url, token=7, specs=(), source_stream=cfg.source.stream,
                        dead_letter_maxlen=cfg.source.dead_letter_maxlen)  # fmt: skip
    records = [
        orjson.dumps({"id": f"{NOW}-{i}", "idx": 0, "reason": "bad_json", "field": None,
                      "raw": "{", "ts": NOW}).decode()
        for i in range(50)
    ]  # fmt: skip
    loading.client.set("before", 1)
    loading.restart(LOAD_S)
    out: list[Any] = []
    writer = threading.Thread(target=lambda: out.extend(write_partition(ctx, _dead_rows(records))))
    writer.start()
    writer.join(30)
    assert not writer.is_alive() and out, "the writer did not finish"
    assert not loading.loading()  # it could only have written once Redis had loaded
    dead = [r for r in out[0].to_pylist() if r["kind"] == "dead"]
    assert dead == [{**dead[0], "reason": "bad_json", "events": 50}]
    stream = dead_letter_stream_key(cfg.source.stream)
    assert loading.client.xlen(stream) == 50
    list(write_partition(ctx, _dead_rows(records)))  # the same batch again: nothing twice
    assert loading.client.xlen(stream) == 50
