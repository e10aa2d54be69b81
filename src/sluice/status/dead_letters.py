"""The dead-letter stream, read back: the newest records, how many there are, and why.

The writer appends one record per bad event to `sluice:dead:{<stream>}` (see
`lua/dead_letters.lua`: fields id, idx, reason, field, raw, ts, batch; the id of a Kafka record
is `<topic>:<partition>@<offset>`, and its item also has those three apart) and counts each
reason in the stats hash as `dead_<reason>`. `sluice dead-letters` and `GET /v1/dead-letters`
read them here. Redis only; nothing is written or removed.

The stream is bounded (`source.dead_letter_maxlen`, trimmed approximately), while the counters
are never trimmed: `total` is what the stream holds now, `by_reason` counts since the start.
"""

from __future__ import annotations

import re
from typing import Any

from sluice.config import Config
from sluice.redis.keys import STATS_KEY
from sluice.source.ids import id_ms
from sluice.source.values import DECODE_REASONS

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
PAGE_ENTRIES = 1000  # XREVRANGE page when filtering by reason
# Every reason a dead letter is written with: the decoder's, and the fold's (an event too far
# ahead of its batch, or older than every metric's retention).
REASONS = (*DECODE_REASONS, "future", "expired")


def reason_error(value: str) -> str | None:
    """Why `value` is no dead-letter reason (a message), or None when it is one."""
    if value in REASONS:
        return None
    return f"{value!r} is not a dead-letter reason; the reasons are {', '.join(REASONS)}"


_KAFKA_ENTRY = re.compile(r"(.+):(\d+)@(\d+)")
_STREAM_ENTRY = re.compile(r"(.+)@(\d+-\d+)")  # an entry of one of several streams


def read_dead_letters(
    client: Any, cfg: Config, limit: int = DEFAULT_LIMIT, reason: str | None = None
) -> dict[str, Any]:
    """`{"total", "by_reason", "items"}`: the newest `limit` records (of `reason`, if given),
    newest first, as JSON-ready dicts.

    Blocks on Redis. Without `reason` it costs one XREVRANGE; with one it pages back through the
    stream until `limit` records match, so at worst it reads the whole (bounded) stream.
    """
    key = cfg.source.dead_letter_stream
    pipe = client.pipeline(transaction=False)
    pipe.xlen(key)
    pipe.hgetall(STATS_KEY)
    total, stats = pipe.execute()
    by_reason = {
        k.decode()[5:]: int(v)
        for k, v in stats.items()
        if k.startswith(b"dead_") and k != b"dead_letters" and v.isdigit()
    }
    items: list[dict[str, Any]] = []
    end = "+"
    while len(items) < limit:
        count = limit - len(items) if reason is None else PAGE_ENTRIES
        page = client.xrevrange(key, end, "-", count=count)
        for dead_id, fields in page:
            item = _item(dead_id, fields)
            if reason is None or item["reason"] == reason:
                items.append(item)
                if len(items) == limit:
                    break
        if len(page) < count:
            break
        end = "(" + page[-1][0].decode()
    return {"total": int(total), "by_reason": dict(sorted(by_reason.items())), "items": items}


def _item(dead_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
    def text(name: bytes) -> str:
        return fields.get(name, b"").decode("utf-8", "replace")

    def number(name: bytes) -> int | None:
        raw = text(name)
        return int(raw) if raw.lstrip("-").isdigit() else None

    item: dict[str, Any] = {
        "dead_id": dead_id.decode(),
        "written_ms": id_ms(dead_id),
        "entry_id": text(b"id"),
        "idx": number(b"idx") or 0,
        "reason": text(b"reason"),
        "field": text(b"field") or None,
        "raw": text(b"raw"),
        "ts": number(b"ts"),
        "token": number(b"batch"),
    }
    kafka = _KAFKA_ENTRY.fullmatch(item["entry_id"])
    if kafka is not None:  # a Kafka record: `<topic>:<partition>@<offset>`
        item.update(topic=kafka.group(1), partition=int(kafka.group(2)), offset=int(kafka.group(3)))
    elif (entry := _STREAM_ENTRY.fullmatch(item["entry_id"])) is not None:
        item["stream"] = entry.group(1)  # `<stream>@<entry id>`
    return item
