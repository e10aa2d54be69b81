"""Options of the Spark source, parsed once from Spark's string options.

The reader keeps only plain, picklable values: the Redis URL, the shard keys, the schema as
(name, type, nullable) triples. Clients are created inside `read()` on the executors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sluice.config import Config, FieldType
from sluice.errors import ConfigError


@dataclass(frozen=True)
class SourceOptions:
    url: str
    shards: tuple[str, ...]
    format: str
    fields: tuple[tuple[str, str, bool], ...]  # (name, type, nullable)
    time_field: str | None
    max_events_per_batch: int | None
    max_string_bytes: int
    partition_events: int = 50_000
    max_partitions_per_shard: int = 8
    flow: str | None = None  # JSON {"backpressure": {...}, "trigger_ms": n}; None = no valve
    max_entry_bytes: int = 8_000_000  # a larger entry is one `oversize_entry` dead letter
    # Several queries may read the same shards, each with its own offsets ("" is the default
    # pipeline). A shard is trimmed only up to the slowest of its `readers`, so they must name
    # every reader of it: one left out may lose input it has not read yet. A shard not listed
    # has this reader alone.
    reader: str = ""
    readers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for shard, names in self.readers.items():
            if self.reader not in names:
                raise ConfigError(
                    f"source `reader` {self.reader!r} is not among the readers {list(names)} of"
                    f" shard {shard!r}; list every reader of a shard, this one included"
                )

    def readers_of(self, shard: str) -> tuple[str, ...]:
        return self.readers.get(shard, (self.reader,))

    def to_spark(self) -> dict[str, str]:
        """Flatten to Spark's `option(k, v)` strings."""
        return {"sluice.source": json.dumps(self.__dict__, default=list)}

    @classmethod
    def from_spark(cls, options: Any) -> SourceOptions:
        raw = options.get("sluice.source")
        if raw is None:
            raise ConfigError(
                "the redis-streams source needs option `sluice.source`;"
                " build it with SourceOptions.from_config(cfg, url).to_spark()"
            )
        data = json.loads(raw)
        data["shards"] = tuple(data["shards"])
        data["fields"] = tuple(tuple(f) for f in data["fields"])
        data["readers"] = {k: tuple(v) for k, v in data.get("readers", {}).items()}
        return cls(**data)

    @classmethod
    def from_config(cls, cfg: Config, url: str) -> SourceOptions:
        types: dict[str, FieldType] = cfg.source.field_types()
        return cls(
            url=url,
            shards=tuple(cfg.source.shard_keys()),
            format=cfg.source.format,
            fields=tuple((n, t.type, t.nullable) for n, t in types.items()),
            time_field=cfg.source.time_field,
            max_events_per_batch=cfg.source.max_events_per_batch,
            max_string_bytes=cfg.source.max_string_bytes,
            max_entry_bytes=cfg.source.max_entry_bytes,
            flow=json.dumps(
                {
                    "backpressure": cfg.backpressure.model_dump(mode="json"),
                    "trigger_ms": cfg.spark.trigger,
                }
            ),
        )
