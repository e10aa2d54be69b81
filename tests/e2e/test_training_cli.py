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
    bad = sluice(*args[:-2], "--out", str(tmp_path / "o2"), "--key", "card")
    assert bad.returncode == 2 and "FIELD=COLUMN" in bad.stderr
    unknown = sluice(*[a if a != "qty_sum:1h" else "nope:1h" for a in args[:-2]], "--out",
                     str(tmp_path / "o3"))  # fmt: skip
    assert unknown.returncode == 1 and "unknown metric 'nope'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
