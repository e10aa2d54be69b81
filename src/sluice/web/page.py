"""The dashboard page served at `GET /`. Its script and styles are package data under
`static/`, served by the app at `/static/…`; nothing is loaded from another origin."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def dashboard_html() -> str:
    return (resources.files("sluice.web") / "static" / "index.html").read_text(encoding="utf-8")
