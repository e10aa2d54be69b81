"""The dashboard page served at `GET /`: one self-contained file, no external assets."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def dashboard_html() -> str:
    return (resources.files("sluice.web") / "static" / "index.html").read_text(encoding="utf-8")
