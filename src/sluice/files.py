"""Small local files that must never be read half-written: a checkpoint's side files (the
written mark, each batch's partial-aggregation choice, the source's start positions)."""

from __future__ import annotations

import os
from pathlib import Path


def read_text(path: Path) -> str | None:
    """The file's text, or None when it does not exist."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, creating its directory: a reader, or a restart after
    a crash, sees the old text or the new one, never a part of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
