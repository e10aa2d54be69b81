"""`sluice backfill` on a real Spark session and a real Redis: archived events folded with the
live fold's plan and answered by the query engine exactly as DuckDB answers over the same
events; re-runs that change nothing; bad rows counted with their reasons; clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from sluice.config import Config
from sluice.errors import ConfigError
from sluice.offline.backfill import backfill, seam_of
from sluice.offline.events import ArchiveError, read_archive
from sluice.offline.progress import Watcher, tasks_key
from sluice.offline.training import training_set
from sluice.query.engine import QueryEngine
from sluice.redis.connection import client_for
from sluice.redis.keys import BACKFILL_PREFIX
from sluice.slices.window import slice_start
from tests.conftest import make_config
from tests.e2e.test_oracle import check, make_events, random_queries
from tests.integration.helpers import slice_snapshot

pytestmark = [pytest.mark.spark]

N = 20_000
TEN_MIN = 600_000


@pytest.fixture(scope="module")
def now_ms() -> int:
    """A time on a 10-minute edge (the coarsest slice but one of the test config), so that
    most metrics' seams fall on it."""
    import time

    return slice_start(time.time_ns() // 1_000_000, TEN_MIN)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory, now_ms: int) -> tuple[Path, pd.DataFrame]:
    events = make_events(now_ms, N)
    where = tmp_path_factory.mktemp("archive")
    half = len(events) // 2
    events.iloc[:half].to_parquet(where / "part-0.parquet")
    events.iloc[half:].to_parquet(where / "part-1.parquet")
    return where, events


def seams(cfg: Config, until_ms: int) -> dict[str, int]:
    return {m.name: seam_of(until_ms, m) for m in cfg.metrics}


def check_below_seams(
    cfg: Config, r: redis.Redis, events: pd.DataFrame, now_ms: int, n: int = 400
) -> int:
    """Random queries (test_oracle's) of the config's metrics whose slices all lie before their
    metrics' seams, checked against DuckDB over exactly the events each answer covers. Returns
    how many were checked."""
    engine = QueryEngine(cfg, r)
    con = duckdb.connect()
    con.register("ev", events)
    seam = seams(cfg, now_ms)
    if "amount_sum" in seam and "merchant_txn" in seam:
        seam["avg_ticket"] = min(seam["amount_sum"], seam["merchant_txn"])
    checked = 0
    for q in random_queries(events, now_ms, n=n):
        if q["metric"] not in seam or (cfg.metric(q["metric"]) is None and not cfg.derived):
            continue
        ans = engine.query(q["metric"], q["key"], q["window"], q["end"])
        if ans["covered_end"] > seam[q["metric"]]:
            continue  # the live fold's slices: not this backfill's
        check(con, ans)
        checked += 1
    return checked


def test_a_backfill_answers_as_the_reference_and_a_rerun_changes_nothing(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    where, events = archive
    cfg = make_config(redis_url, tmp_path)
    seen: list[dict[str, Any]] = []
    report = backfill(spark, cfg, str(where), until_ms=now_ms, progress=seen.append,
                      progress_every_s=0.2)  # fmt: skip
    assert report.events == N and report.dead == {}
    assert report.seams == seams(cfg, now_ms)
    # Each write task said how far it was: every partition ended, its events and slices summing
    # to the report's; what a progress line says once the writes are done.
    run_key = f"{BACKFILL_PREFIX}:{report.run}"
    assert r.hlen(tasks_key(run_key)) == report.partitions
    last = Watcher(spark, "none", r, run_key, report.partitions, seen.append, 1.0).snapshot()
    assert last["phase"] == "writing" and last["left_s"] == 0
    assert last["partitions_done"] == last["partitions"] == report.partitions
    assert (last["events"], last["slices"]) == (report.events, report.slices)
    assert report.slices > 0 and report.partitions_skipped == 0
    assert check_below_seams(cfg, r, events, now_ms) >= 200
    stored = slice_snapshot(r)
    # The same run again: every partition was written, so none is written again.
    again = backfill(spark, cfg, str(where), until_ms=now_ms)
    assert again.partitions_skipped == again.partitions > 0 and again.run == report.run
    assert any("nothing was read" in w for w in again.warnings), again.warnings
    assert slice_snapshot(r) == stored
    # Written again from scratch: the slices replace themselves with the same states.
    fresh = backfill(spark, cfg, str(where), until_ms=now_ms, fresh=True)
    assert fresh.partitions_skipped == 0 and fresh.slices == report.slices
    assert slice_snapshot(r) == stored
    assert json.loads(r.lindex("sluice:{backfill}:runs", 0))["run"] == report.run
    assert {k.decode(): int(v) for k, v in r.hgetall("sluice:{backfill}:seams").items()} == (
        report.seams
    )
    assert seen and seen[-1]["tasks"] >= seen[-1]["tasks_done"] >= 0


def test_a_backfill_into_a_redis_cluster_answers_as_the_reference(
    spark: Any, redis_cluster: Any, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """The same archive into a Redis Cluster of 3 masters (each write task's RESTOREs and
    script calls grouped by slot, the seams on their own node): answers as DuckDB's, and a
    training set from the cluster's store gives the archive's values. (Re-runs on a cluster:
    tests/integration/test_slice_restore.py.)"""
    redis_cluster.flushall()
    where, events = archive
    cfg = make_config(redis_cluster.url, tmp_path)
    client = client_for(redis_cluster.url)
    try:
        report = backfill(spark, cfg, str(where), until_ms=now_ms)
        assert report.events == N and report.dead == {} and report.slices > 0
        assert check_below_seams(cfg, client, events, now_ms) >= 200
        cards = events["card"].value_counts().index[:10].tolist()
        ends = [slice_start(now_ms - k * 137_000, 60_000) - 1 for k in range(1, 21)]
        spine = spark.createDataFrame(pd.DataFrame({"card": cards * 2, "t": ends}))
        feats = {"txn_count": ["10m", "30m"], "card_max": ["17m"]}
        from_store = training_set(spark, cfg, spine, feats, ts="t").toPandas()
        from_archive = training_set(spark, cfg, spine, feats, ts="t",
                                    events=spark.read.parquet(str(where))).toPandas()  # fmt: skip
        cols = ["card", "t", "txn_count_10m", "txn_count_30m", "card_max_17m"]
        assert from_store[cols].equals(from_archive[cols])
        assert from_store["txn_count_30m"].sum() > 0
    finally:
        client.close()


def test_a_partial_store_is_made_exact_by_a_rerun(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """What a backfill killed halfway leaves (some slices written, others not, some from an
    older archive) is made exact by running it again: its slices replace, never add."""
    where, events = archive
    cfg = make_config(redis_url, tmp_path)
    backfill(spark, cfg, str(where / "part-0.parquet"), until_ms=now_ms)  # an older archive
    keys = sorted(r.scan_iter(match="sluice:s:*"))
    for k in keys[::3]:
        r.delete(k)  # partitions that never ran
    backfill(spark, cfg, str(where), until_ms=now_ms)
    assert check_below_seams(cfg, r, events, now_ms) >= 200


def test_start_and_until_bound_the_slices_written(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    where, events = archive
    cfg = make_config(redis_url, tmp_path, derived=[], metrics=[
        {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "1m", "retention": "1d"},
    ])  # fmt: skip
    start, until = now_ms - 30 * 60_000 + 12_345, now_ms - 10 * 60_000 + 5_000
    report = backfill(spark, cfg, str(where), start_ms=start, until_ms=until)
    first, seam = slice_start(start, 60_000), slice_start(until, 60_000)
    assert report.first_slices == {"txn_count": first} and report.seams == {"txn_count": seam}
    want = events[(events.ts >= first) & (events.ts < seam)].groupby("card").size()
    engine = QueryEngine(cfg, r)
    for card, n in want.head(50).items():
        got = engine.query("txn_count", card, "1h", seam - 1)["value"]
        assert got == n, card
    assert report.events == int(want.sum())


def test_bad_rows_are_counted_with_their_reasons(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    cfg = make_config(redis_url, tmp_path)
    t = now_ms - 60_000
    lines = [
        json.dumps({"ts": t, "card": "c1", "merchant": "m1", "amount": 2.5, "qty": 1}),
        json.dumps({"ts": t, "card": "c1", "merchant": "m1", "amount": "x", "qty": 1}),
        "",
        "not json",
        json.dumps({"ts": t, "merchant": "m1", "amount": 1.0, "qty": 1}),
        json.dumps({"card": "c2", "merchant": "m1", "amount": 1.0, "qty": 1}),
        json.dumps({"ts": t, "card": "c3", "merchant": "m1", "amount": 1.0, "qty": 2}),
    ]
    lines += [json.dumps({"ts": t, "card": "c1", "merchant": "m1", "amount": "x", "qty": 1})] * 40
    # As the live decoder judges them: a number as text, a card as a number, not an object, a
    # long past its range; blank lines are no rows
    lines += [
        json.dumps({"ts": t, "card": "c4", "merchant": "m1", "amount": "12.5", "qty": 1}),
        json.dumps({"ts": t, "card": 4, "merchant": "m1", "amount": 1.0, "qty": 1}),
        "[1, 2, 3]",
        f'{{"ts": {t}, "card": "c5", "merchant": "m1", "amount": 1.0, "qty": 1{"0" * 20}}}',
        "",
        "   ",
    ]
    path = tmp_path / "events.jsonl"
    # The last line is cut inside a UTF-8 character (a file truncated mid-write).
    cut = f'{{"ts": {t}, "card": "c6", "merchant": "Caf'.encode() + "é".encode()[:1]
    path.write_bytes(("\n".join(lines) + "\n").encode() + cut)
    report = backfill(spark, cfg, str(path), until_ms=now_ms)
    assert report.events == 2
    # 41 identical bad rows fold into one dead-letter record, and count 41
    assert report.dead == {"bad_type": 43, "out_of_range": 1, "bad_json": 1, "missing_field": 2,
                           "not_object": 1, "invalid_utf8": 1}  # fmt: skip
    assert any("events.jsonl" in x for x in report.samples["bad_type"])
    assert "not json" in report.samples["bad_json"][0]
    # a bad line is named by its file and its line number (blank lines counted, from 1)
    assert json.loads(report.samples["bad_json"][0])["id"].endswith("events.jsonl:0@4")
    assert QueryEngine(cfg, r).query("merchant_txn", "m1", "10m", t)["value"] == 2
    # A line the decoder refuses is bounded by its time key as the rest are: one before --start
    # (rounded down to the coarsest slice, 1 h) or after --until is counted there, not as bad.
    bad = {"card": "c9", "merchant": "m9", "amount": "x", "qty": 1}
    (tmp_path / "bounded.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {**bad, "amount": 1.0, "ts": t}, {**bad, "ts": t}, {**bad, "ts": t - 3 * 3_600_000},
        {**bad, "ts": t + 30_000},
    ]))  # fmt: skip
    report = backfill(spark, cfg, str(tmp_path / "bounded.jsonl"), start_ms=t - 30_000,
                      until_ms=t + 10_000)  # fmt: skip
    assert (report.events, report.dead) == (1, {"bad_type": 1}), report
    assert (report.before_start, report.after_until) == (1, 1), report


def test_csv_quoted_as_pandas_writes_it_keeps_its_keys_in_the_archive_and_the_spine(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    """A double quote inside a quoted field is written twice (RFC 4180; pandas, Python's csv):
    read so, the merchant `m "q"` is that key, not the field's text with its quoting. A spine's
    passed-through text keeps its quotes and line breaks."""
    from sluice.training_cli import read_table

    cfg = make_config(redis_url, tmp_path)
    t = now_ms - 60_000
    merchants = ['m "q"', "m, comma", "plain"]
    pd.DataFrame({"ts": [t] * 3, "card": ["c1"] * 3, "merchant": merchants, "amount": 1.0,
                  "qty": 1}).to_csv(tmp_path / "events.csv", index=False)  # fmt: skip
    report = backfill(spark, cfg, str(tmp_path / "events.csv"), until_ms=now_ms)
    assert report.events == 3 and report.dead == {}, report.dead
    engine = QueryEngine(cfg, r)
    assert [engine.query("merchant_txn", m, "10m", t)["value"] for m in merchants] == [1, 1, 1]
    notes = ['said "stop"', "line one\nline two", ""]
    pd.DataFrame({"merchant": merchants, "t": [t] * 3, "note": notes}).to_csv(
        tmp_path / "spine.csv", index=False)  # fmt: skip
    spine = read_table(spark, str(tmp_path / "spine.csv"), None, ["merchant"])
    table = training_set(spark, cfg, spine, {"merchant_txn": ["10m"]}, "t",
                         events=read_archive(spark, str(tmp_path / "events.csv"), "csv",
                                             cfg.source.schema_)).toPandas()  # fmt: skip
    assert table["merchant"].tolist() == merchants
    assert table["note"].tolist() == ['said "stop"', "line one\nline two", None]  # CSV: "" is null
    assert table["merchant_txn_10m"].tolist() == [1, 1, 1]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_row_older_than_every_retention_is_named_in_its_sample(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int, fmt: str
) -> None:
    """An `expired` row is found so by the fold's plan, not by the decoder; its sample still
    names it by its file and row (Parquet) or line (JSON lines), as a bad row's does."""
    cfg = make_config(redis_url, tmp_path)
    rows = [{"ts": now_ms - 60_000, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1},
            {"ts": now_ms - 2 * 86_400_000, "card": "c1", "merchant": "m1", "amount": 1.0,
             "qty": 1}]  # fmt: skip
    path = tmp_path / f"events.{fmt}"
    if fmt == "parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = backfill(spark, cfg, str(path), until_ms=now_ms)
    assert report.events == 1 and report.dead == {"expired": 1}
    named = json.loads(report.samples["expired"][0])["id"]
    assert named.endswith("events.parquet#1" if fmt == "parquet" else "events.jsonl:0@2"), named


def test_clear_errors(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    cfg = make_config(redis_url, tmp_path)
    with pytest.raises(ArchiveError, match="cannot read parquet input"):
        backfill(spark, cfg, str(tmp_path / "nowhere"), until_ms=now_ms)
    with pytest.raises(ConfigError, match="metric 'nope' is unknown"):
        backfill(spark, cfg, str(tmp_path), metrics=["nope"], until_ms=now_ms)
    pd.DataFrame({"ts": [1], "merchant": ["m"]}).to_parquet(tmp_path / "narrow.parquet")
    with pytest.raises(ArchiveError, match="input has no column 'card'"):
        backfill(spark, cfg, str(tmp_path / "narrow.parquet"), until_ms=now_ms)
    # Parquet read as CSV: its header is its bytes, shown escaped and short, with a hint
    with pytest.raises(ArchiveError, match=r"its columns are PAR1.*\(not text: is the input in"):
        backfill(spark, cfg, str(tmp_path / "narrow.parquet"), fmt="csv", until_ms=now_ms)
    with pytest.raises(
        ArchiveError, match=r"S3AFileSystem, is not on Spark's classpath.*hadoop-aws"
    ):
        backfill(spark, cfg, "s3a://lake/payments/", until_ms=now_ms)
    (tmp_path / "narrow.jsonl").write_text(json.dumps({"ts": 1, "merchant": "m"}) + "\n")
    with pytest.raises(
        ArchiveError, match=r"no column 'card'.*first lines have the keys merchant, ts"
    ):
        backfill(spark, cfg, str(tmp_path / "narrow.jsonl"), until_ms=now_ms)
    floats = pd.DataFrame({"ts": [now_ms - 1000], "card": [1.0], "merchant": ["m"],
                           "amount": [1.0], "qty": [1]})  # fmt: skip
    floats.to_parquet(tmp_path / "floats.parquet")  # 1.0 is no key the live source reads
    with pytest.raises(ArchiveError, match=r"column 'card' is double and source.schema says"):
        backfill(spark, cfg, str(tmp_path / "floats.parquet"), until_ms=now_ms)
    nanos = pd.DataFrame({"ts": pd.to_datetime([now_ms - 1000], unit="ms"), "card": ["c"],
                          "merchant": ["m"], "amount": [1.0], "qty": [1]})  # fmt: skip
    nanos.to_parquet(tmp_path / "nanos.parquet")  # pandas writes its timestamps in ns
    with pytest.raises(ArchiveError, match=r"timestamp column in nanoseconds.*coerce_timestamps"):
        backfill(spark, cfg, str(tmp_path / "nanos.parquet"), until_ms=now_ms)


def test_a_file_spark_cannot_read_is_named_and_a_rerun_without_it_finishes(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    cfg = make_config(redis_url, tmp_path)
    where = tmp_path / "lake"
    where.mkdir()
    t = now_ms - 60_000
    pd.DataFrame({"ts": [t, t], "card": ["c1", "c2"], "merchant": ["m9", "m9"],
                  "amount": [1.0, 2.0], "qty": [1, 1]}).to_parquet(where / "a.parquet")  # fmt: skip
    (where / "b.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(ArchiveError, match=r"cannot read \S*b\.parquet: .*not a Parquet file.*"
                       "Nothing was written"):  # fmt: skip
        backfill(spark, cfg, str(where), until_ms=now_ms)
    assert QueryEngine(cfg, r).query("merchant_txn", "m9", "10m", t)["value"] == 0
    (where / "b.parquet").unlink()
    report = backfill(spark, cfg, str(where), until_ms=now_ms)
    assert report.events == 2
    assert QueryEngine(cfg, r).query("merchant_txn", "m9", "10m", t)["value"] == 2


def test_until_after_now_or_before_every_retention_is_refused(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    from sluice.offline.backfill import BackfillError

    cfg = make_config(redis_url, tmp_path)
    with pytest.raises(BackfillError, match="is after the store's clock"):
        backfill(spark, cfg, str(tmp_path), until_ms=2**50)
    with pytest.raises(BackfillError, match="older than the retention of every metric"):
        backfill(spark, cfg, str(tmp_path), until_ms=now_ms // 1000)  # seconds, by mistake


def test_a_file_rewritten_in_place_is_read_again_and_rows_outside_the_bounds_are_counted(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    """A re-run with the same --until skips the partitions it wrote only while its files are
    the same: a file re-exported with more events is folded again. Rows before --start and
    after --until are counted, not silently left out."""
    cfg = make_config(redis_url, tmp_path)
    t = now_ms - 5 * 60_000

    def export(n: int) -> None:
        pd.DataFrame({"ts": [t] * n, "card": "c1", "merchant": "m7", "amount": 1.0,
                      "qty": 1}).to_parquet(tmp_path / "day.parquet")  # fmt: skip

    export(10)
    assert backfill(spark, cfg, str(tmp_path / "day.parquet"), until_ms=now_ms).events == 10
    export(25)
    again = backfill(spark, cfg, str(tmp_path / "day.parquet"), until_ms=now_ms)
    assert again.events == 25 and again.partitions_skipped == 0
    assert QueryEngine(cfg, r).query("merchant_txn", "m7", "10m", t)["value"] == 25
    same = backfill(spark, cfg, str(tmp_path / "day.parquet"), until_ms=now_ms)
    assert same.run == again.run and same.partitions_skipped == same.partitions
    # what decides which rows count is part of the run: changed, every partition is written
    strict = cfg.model_copy(update={"source": cfg.source.model_copy(
        update={"max_string_bytes": 64})})  # fmt: skip
    other = backfill(spark, strict, str(tmp_path / "day.parquet"), until_ms=now_ms)
    assert other.run != again.run and other.partitions_skipped == 0 and other.events == 25
    pd.DataFrame({"ts": [t - 3_600_000, t, t, now_ms + 1], "card": "c2", "merchant": "m8",
                  "amount": 1.0, "qty": 1}).to_parquet(tmp_path / "wide.parquet")  # fmt: skip
    bounded = backfill(spark, cfg, str(tmp_path / "wide.parquet"), start_ms=t - 60_000,
                       until_ms=now_ms)  # fmt: skip
    assert (bounded.events, bounded.before_start, bounded.after_until) == (2, 1, 1)


def test_formats_are_told_by_their_suffixes_and_an_empty_input_is_said_to_be(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    import gzip

    cfg = make_config(redis_url, tmp_path)
    t = now_ms - 60_000
    row = {"ts": t, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1}
    with gzip.open(tmp_path / "events.jsonl.gz", "wt") as f:
        f.write(json.dumps(row) + "\n")
    assert backfill(spark, cfg, str(tmp_path / "events.jsonl.gz"), until_ms=now_ms).events == 1
    # a directory's format is the one its files' suffixes name
    (tmp_path / "lines").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "lines" / name).write_text(json.dumps(row) + "\n")
    assert backfill(spark, cfg, str(tmp_path / "lines"), until_ms=now_ms).events == 2
    pd.DataFrame([row]).to_parquet(tmp_path / "more.parquet")
    pd.DataFrame([row]).to_parquet(tmp_path / "lines" / "c.parquet")  # ... and only one
    with pytest.raises(ArchiveError, match=r"holds files of more than one format \(jsonl, parq"):
        backfill(spark, cfg, str(tmp_path / "lines"), until_ms=now_ms)
    with pytest.raises(ArchiveError, match=r"more than one format.*run one backfill per format"):
        backfill(spark, cfg, [str(tmp_path / "events.jsonl.gz"), str(tmp_path / "more.parquet")],
                 until_ms=now_ms)  # fmt: skip
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArchiveError, match="no data found in it"):
        backfill(spark, cfg, str(tmp_path / "empty"), until_ms=now_ms)
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ArchiveError, match=r"no columns: it is empty \(or only blank lines\), or"):
        backfill(spark, cfg, str(tmp_path / "empty.csv"), until_ms=now_ms)
    for text in ("", "\n  \n"):  # nothing to fold: no seam is recorded
        (tmp_path / "empty.jsonl").write_text(text)
        with pytest.raises(ArchiveError, match=r"no columns: it is empty \(or only blank lines\)"):
            backfill(spark, cfg, str(tmp_path / "empty.jsonl"), until_ms=now_ms)
    # Parquet's own types: a fraction where an integer is due is no integer (a cast would drop
    # it), a boolean is no number; whole doubles convert
    typed = pd.DataFrame({"ts": [t + 0.5, float(t), float(t), float(t)],
                          "card": "c9", "merchant": "m1", "amount": [1.0, 1.0, 1.0, 1.0],
                          "qty": [1.0, 2.5, 3.0, 1.0]})  # fmt: skip
    typed.to_parquet(tmp_path / "typed.parquet")
    report = backfill(spark, cfg, str(tmp_path / "typed.parquet"), until_ms=now_ms)
    assert (report.events, report.dead) == (2, {"bad_type": 2})
    # each bad row is named by its file and its place in it (Parquet's row index, from 0)
    ids = {json.loads(x)["id"].rsplit("/", 1)[-1] for x in report.samples["bad_type"]}
    assert ids == {"typed.parquet#0", "typed.parquet#1"}
    pd.DataFrame({"ts": [t], "card": "c9", "merchant": "m1", "amount": [True],
                  "qty": [1]}).to_parquet(tmp_path / "flag.parquet")  # fmt: skip
    flagged = backfill(spark, cfg, str(tmp_path / "flag.parquet"), until_ms=now_ms)
    assert (flagged.events, flagged.dead) == (0, {"bad_type": 1})
    # a boolean column's null, in a nullable field, is only a missing value
    nulls = pa.table({"ts": [t], "card": ["c9"], "merchant": ["m1"], "amount": [1.0],
                      "qty": [1], "note": pa.array([None], pa.bool_())})  # fmt: skip
    pq.write_table(nulls, tmp_path / "nulls.parquet")
    cfg_note = cfg.model_copy(update={"source": cfg.source.model_copy(
        update={"schema_": {**cfg.source.schema_, "note": "string?"}})})  # fmt: skip
    kept = backfill(spark, cfg_note, str(tmp_path / "nulls.parquet"), until_ms=now_ms)
    assert (kept.events, kept.dead) == (1, {})
