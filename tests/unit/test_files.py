"""Checkpoint side files: read back as written, replaced whole, never left half-written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sluice.files import read_text, replace_text


def test_missing_file_reads_as_none(tmp_path: Path) -> None:
    assert read_text(tmp_path / "absent") is None


def test_replace_creates_the_directory_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "mark"
    replace_text(path, "41")
    replace_text(path, "42")
    assert read_text(path) == "42"
    assert sorted(p.name for p in path.parent.iterdir()) == ["mark"]


def test_replace_keeps_the_old_text_when_the_write_fails(tmp_path: Path) -> None:
    path = tmp_path / "mark"
    replace_text(path, "old")
    blocker = tmp_path / f".mark.{os.getpid()}.tmp"
    blocker.mkdir()  # the temporary file cannot be created: the write fails before the rename
    with pytest.raises(OSError):
        replace_text(path, "new")
    assert read_text(path) == "old"
