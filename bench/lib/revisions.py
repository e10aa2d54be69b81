"""Revisions of src/ measured side by side in one run: `before` (a commit, exported) and the
working tree (`after`), in alternating order over the rounds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from lib.results import ROOT

REVISIONS = ("before", "after")


def export(revision: str, into: Path) -> Path:
    """`revision`'s src/ under `into` (git archive); returns that src directory."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def order(rnd: int) -> tuple[str, ...]:
    """Round `rnd`'s order (0-based): before first in odd rounds, after first in even ones."""
    return REVISIONS if rnd % 2 == 0 else REVISIONS[::-1]
