"""Batch 0's audit starts where the source began its checkpoint (`audit.batch_offsets`)."""

from __future__ import annotations

import json
from pathlib import Path

from sluice.pipeline.audit import OFFSETS_FIELDS, batch_offsets
from sluice.source.kafka import KafkaLog
from sluice.source.reader import START_FILE
from sluice.source.streams import RedisStreamsLog


def test_the_audit_knows_every_logs_offsets_field() -> None:
    assert set(OFFSETS_FIELDS) == {KafkaLog.OFFSETS_FIELD, RedisStreamsLog.OFFSETS_FIELD}


def _log(ckpt: Path, batch: int, offsets: dict[str, int]) -> None:
    (ckpt / "offsets").mkdir(parents=True, exist_ok=True)
    lines = ["v1", "{}", json.dumps({"offsets": offsets, "ref": 0})]
    (ckpt / "offsets" / str(batch)).write_text("\n".join(lines) + "\n")


def test_batch_zero_starts_at_the_kept_start_positions(tmp_path: Path) -> None:
    _log(tmp_path, 0, {"0": 80, "1": 30})
    _log(tmp_path, 1, {"0": 90, "1": 30})
    assert batch_offsets(tmp_path, 0)[0] == {}  # a checkpoint from before the start file
    (tmp_path / START_FILE).write_text(json.dumps({"0": 75, "1": 25}))
    assert batch_offsets(tmp_path, 0) == ({"offsets": {"0": 75, "1": 25}},
                                          {"offsets": {"0": 80, "1": 30}, "ref": 0})  # fmt: skip
    assert batch_offsets(tmp_path, 1)[0] == {"offsets": {"0": 80, "1": 30}, "ref": 0}
