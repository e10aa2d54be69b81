"""`sluice training-set`, `sluice consistency` and `sluice demo-offline` as users run them: real
processes, real Spark and Redis. The demo runs the whole offline side (archive, backfill, a
training table, the consistency check); the training-set command's table is the Python API's,
row for row; usage errors are one clear line before Spark starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.conftest import config_data

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SLUICE = str(Path(sys.executable).with_name("sluice"))


def sluice(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SLUICE, *args], capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def test_the_offline_demo_runs_end_to_end(tmp_path: Path) -> None:
    res = sluice("demo-offline", "--events", "20000", "--rows", "300", "--state-dir",
                 str(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "sluice backfill" in out and "sluice training-set" in out, out
    assert "3 matched, 0 mismatched, 0 missing of 3 logged answers" in out, out
    table = pd.read_parquet(tmp_path / "offline" / "training.parquet")
    assert len(table) == 300
    assert {"card_id", "is_fraud", "txn_count_10m", "txn_count_3d", "avg_ticket_1d"} <= set(
        table.columns
    )
    assert (table["txn_count_3d"] >= table["txn_count_1d"]).all()
    assert "Traceback" not in res.stderr


def test_the_command_writes_the_api_s_table_and_refuses_bad_usage(
    spark: Any, redis_url: str, tmp_path: Path
) -> None:
    from sluice.config import config_from_dict
    from sluice.offline.training import training_set

    data = config_data(redis_url, tmp_path / "state", derived=[])
    data["metrics"] = [m for m in data["metrics"] if m["name"] in ("txn_count", "qty_sum")]
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    rng = np.random.default_rng(1)
    now = 1_800_000_000_000
    ev = pd.DataFrame({"ts": rng.integers(now - 3_600_000, now, 3000),
                       "card": [f"c{i}" for i in rng.integers(0, 20, 3000)],
                       "merchant": [f"m{i}" for i in rng.integers(0, 5, 3000)],
                       "amount": rng.random(3000), "qty": rng.integers(0, 9, 3000)})  # fmt: skip
    ev.to_parquet(tmp_path / "events.parquet")
    spine = pd.DataFrame({"card_id": [f"c{i}" for i in rng.integers(0, 20, 100)],
                          "merchant": [f"m{i}" for i in rng.integers(0, 5, 100)],
                          "when": rng.integers(now - 1_800_000, now, 100)})  # fmt: skip
    spine.to_csv(tmp_path / "spine.csv", index=False)
    out = tmp_path / "table.parquet"
    args = ["training-set", "-c", str(path), "--spine", str(tmp_path / "spine.csv"),
            "--ts", "when", "--key", "card=card_id", "--features", "txn_count:1m,17m",
            "--features", "qty_sum:1h", "--input", str(tmp_path / "events.parquet"),
            "--out", str(out)]  # fmt: skip
    res = sluice(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["rows"] == 100
    assert summary["columns"] == ["txn_count_1m", "txn_count_17m", "qty_sum_1h"]
    got = pd.read_parquet(out)
    want = training_set(
        spark, config_from_dict(data), spark.createDataFrame(spine),
        {"txn_count": ["1m", "17m"], "qty_sum": ["1h"]}, ts="when", keys={"card": "card_id"},
        events=spark.read.parquet(str(tmp_path / "events.parquet")),
    ).toPandas()  # fmt: skip
    cols = ["txn_count_1m", "txn_count_17m", "qty_sum_1h"]
    assert got[cols].values.tolist() == want[cols].values.tolist()
    again = sluice(*args)
    assert again.returncode == 1 and "exists; pass --overwrite" in again.stderr
    over = sluice(*args[:-2], "--out", str(tmp_path / "events.parquet"), "--overwrite")
    assert over.returncode == 2 and "would overwrite the input" in over.stderr, over.stderr
    assert (tmp_path / "events.parquet").is_file()  # not deleted
    bad = sluice(*args[:-2], "--out", str(tmp_path / "o2"), "--key", "card")
    assert bad.returncode == 2 and "FIELD=COLUMN" in bad.stderr
    unknown = sluice(*[a if a != "qty_sum:1h" else "nope:1h" for a in args[:-2]], "--out",
                     str(tmp_path / "o3"))  # fmt: skip
    assert unknown.returncode == 1 and "unknown metric 'nope'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr


def test_as_known_at_reads_stream_entry_ids_and_reports_rows_it_cannot_place(
    redis_url: str, tmp_path: Path
) -> None:
    """A JSON-lines archive whose arrival column holds Redis Stream entry ids: each counts from
    its entry's time; a row with no arrival, or one that is no time, counts nowhere and is
    reported with its reason where the table read its time (not one from 10 h before)."""
    import duckdb

    from sluice.slices.window import slice_start

    data = config_data(redis_url, tmp_path / "state", derived=[])
    data["metrics"] = [m for m in data["metrics"] if m["name"] == "txn_count"]
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    slice_ms = 10_000  # txn_count's slice in the test config
    rng = np.random.default_rng(7)
    now, n = 1_800_000_000_000, 2000
    ts = rng.integers(now - 3_600_000, now, n)
    arrived = ts + np.where(rng.random(n) < 0.3, rng.integers(20_000, 600_000, n), 0)
    cards = [f"c{i}" for i in rng.integers(0, 6, n)]
    ids: list[str | None] = [f"{a}-{i % 3}" for i, a in enumerate(arrived)]
    ids[5], ids[17], ids[40] = None, "soon", "12-x"
    ts[[5, 17, 40]] = now - 60_000  # within what the table reads: counted
    ts[60], ids[60] = now - 36_000_000, "old"  # 10 h back, before any row's window: not read
    with (tmp_path / "events.jsonl").open("w") as f:
        for i in range(n):
            rec = {"ts": int(ts[i]), "card": cards[i], "merchant": "m0", "amount": 1.0,
                   "qty": 1, "seen": ids[i]}  # fmt: skip
            f.write(json.dumps({k: v for k, v in rec.items() if v is not None}) + "\n")
    spine = pd.DataFrame({"card": [f"c{i}" for i in rng.integers(0, 6, 80)],
                          "t": rng.integers(now - 1_800_000, now, 80)})  # fmt: skip
    spine.to_parquet(tmp_path / "spine.parquet")
    out = tmp_path / "table.parquet"
    res = sluice("training-set", "-c", str(path), "--spine", str(tmp_path / "spine.parquet"),
                 "--ts", "t", "--features", "txn_count:1m,20m", "--as-known-at", "seen",
                 "--input", str(tmp_path / "events.jsonl"), "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["bad_rows"] == {"missing_field": 1, "bad_type": 2}, summary
    assert "bad input rows: 3" in res.stderr and "e.g. seen:" in res.stderr, res.stderr
    ev = pd.DataFrame({"ts": ts, "card": cards, "arrived": arrived})
    ev = ev.drop(index=[5, 17, 40, 60])
    con = duckdb.connect()
    con.register("ev", ev)
    got = pd.read_parquet(out)
    late_mattered = 0
    for _, row in got.iterrows():
        t = int(row.t)
        for window, w_ms in [("1m", 60_000), ("20m", 1_200_000)]:
            lo = slice_start(t - w_ms + 1, slice_ms)
            sql = "SELECT count(*) FROM ev WHERE card = ? AND ts >= ? AND ts <= ?"
            want = con.execute(sql + " AND arrived <= ?", [row.card, lo, t, t]).fetchone()
            assert row[f"txn_count_{window}"] == want[0], (window, t, row.card)
            every = con.execute(sql, [row.card, lo, t]).fetchone()
            late_mattered += every[0] != want[0]
    assert late_mattered > 5


def test_a_csv_spine_keeps_its_keys_as_written_and_its_problems_are_reported(
    r: Any, redis_url: str, tmp_path: Path
) -> None:
    """Keys `0042`, `42` and `00100` stay three cards (not numbers); a row whose two-field key
    lacks a part gets nulls, not zeros; rows with no time or an unreadable one are counted.
    `consistency` with no logged answer (`r` empties the store), or none it can check, exits 4:
    a check of nothing is no pass."""
    data = config_data(redis_url, tmp_path / "state", derived=[])
    data["metrics"] = [m for m in data["metrics"] if m["name"] in ("txn_count", "pair_count")]
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    now = 1_800_000_000_000
    counts = {"0042": 3, "42": 5, "00100": 2}
    cards = [c for c, n in counts.items() for _ in range(n)]
    ev = pd.DataFrame({"ts": [now - 60_000 - i for i in range(len(cards))], "card": cards,
                       "merchant": "m1", "amount": 1.0, "qty": 1})  # fmt: skip
    ev.to_parquet(tmp_path / "events.parquet")
    lines = ["card,merchant,t,label"]
    lines += [f"{c},m1,{now - 1},1" for c in counts]
    lines += [f"42,,{now - 1},0", "42,m1,,0", "42,m1,yesterday,0"]
    (tmp_path / "spine.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "table.parquet"
    res = sluice("training-set", "-c", str(path), "--spine", str(tmp_path / "spine.csv"),
                 "--ts", "t", "--features", "txn_count:1h", "--features", "pair_count:1h",
                 "--input", str(tmp_path / "events.parquet"), "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = pd.read_parquet(out)
    assert got["card"].tolist() == ["0042", "42", "00100", "42", "42", "42"]
    assert got["txn_count_1h"].tolist()[:4] == [3, 5, 2, 5]
    assert got["pair_count_1h"].tolist()[:3] == [3, 5, 2]
    assert got["pair_count_1h"].isna().tolist()[3:] == [True, True, True]
    assert got["label"].tolist() == [1, 1, 1, 0, 0, 0]  # other columns keep their inferred type
    warnings = json.loads(res.stdout)["spine_warnings"]
    assert any(w.startswith("1 rows have no time") for w in warnings), warnings
    assert any("1 rows have a 't' that is no time (e.g. 'yesterday'" in w for w in warnings)
    assert any(w.startswith("1 rows lack a key") for w in warnings), warnings
    assert "training-set: warning: 1 rows lack a key" in res.stderr
    nothing = sluice("consistency", "-c", str(path), "--input", str(tmp_path / "events.parquet"))
    assert nothing.returncode == 4, nothing.stderr[-2000:]
    assert "nothing was checked: the store holds no logged answers" in nothing.stderr
    # Answers logged, but none that can be checked (their metric is no longer configured): all
    # missing, exit 4.
    from sluice.config import config_from_dict
    from tests.integration.test_consistency import ask

    ask(r, config_from_dict(data), now + 5_000,
        [{"metric": "txn_count", "key": ["42"], "window": "1h", "end": now - 1}])  # fmt: skip
    fewer = tmp_path / "fewer.yaml"
    fewer.write_text(
        yaml.safe_dump(
            {**data, "metrics": [m for m in data["metrics"] if m["name"] == "pair_count"]}
        )
    )
    nothing = sluice("consistency", "-c", str(fewer), "--input", str(tmp_path / "events.parquet"))
    assert nothing.returncode == 4, nothing.stderr[-2000:]
    assert "no answer was compared: 1 missing, 0 skipped" in nothing.stderr, nothing.stderr
    nowhere = str(tmp_path / "nope.csv")
    missing = sluice("training-set", "-c", str(path), "--spine", nowhere, "--ts", "t",
                     "--features", "txn_count:1h", "--out", str(tmp_path / "o"))  # fmt: skip
    assert missing.returncode == 1, missing.stderr
    assert f"spine {nowhere!r} does not exist" in missing.stderr
