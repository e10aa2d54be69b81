"""A small HTTP client for the Sluice API.

with Client("http://127.0.0.1:8000") as c:
    c.query("txn_count", "card-1", "15m")["value"]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from sluice.errors import BackpressureError, BadQuery, QueryError, SluiceError, UnknownMetric


class Client:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code < 400:
            return r.json()
        try:
            err = r.json()["error"]
            message = f"{err['code']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        if r.status_code == 404:
            raise UnknownMetric(message)
        if r.status_code in (400, 422):
            raise BadQuery(message, status=r.status_code)
        if r.status_code == 429:
            raise BackpressureError(float(r.headers.get("retry-after", "1")), message)
        raise SluiceError(f"HTTP {r.status_code}: {message}")

    def query(
        self, metric: str, key: str | Sequence[str], window: str, end: int | None = None
    ) -> dict[str, Any]:
        """One metric for one key over (end - window, end]. Raises UnknownMetric / BadQuery."""
        keys = [key] if isinstance(key, str) else list(key)
        params: list[tuple[str, str | int | float | bool | None]] = [("key", k) for k in keys]
        params.append(("window", window))
        if end is not None:
            params.append(("end", str(end)))
        return self._check(self._http.get(f"/v1/metrics/{metric}", params=params))

    def query_many(self, queries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Many lookups in one request; each is {"metric", "key", "window", "end"?}."""
        body = {"queries": [dict(q) for q in queries]}
        return self._check(self._http.post("/v1/query", json=body))["results"]

    def metrics(self) -> list[dict[str, Any]]:
        return self._check(self._http.get("/v1/metrics"))["metrics"]

    def status(self) -> dict[str, Any]:
        return self._check(self._http.get("/v1/status"))

    def send_events(self, events: Sequence[Mapping[str, Any]]) -> int:
        """POST events; returns how many were accepted. Raises BackpressureError on 429."""
        return int(self._check(self._http.post("/v1/events", json=list(events)))["accepted"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


__all__ = ["Client", "QueryError"]
