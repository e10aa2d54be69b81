"""Options of the Spark source, parsed once from Spark's string options.

The reader keeps only plain, picklable values: the Redis URL, the log to read (its spec from
`sluice.graph`: the shard keys of a Redis stream, or a Kafka topic), the schema as
(name, type, nullable) triples, and the reading stage's flow settings. Clients are created on
first use, on the driver for planning and inside `read()` on the executors.

Spark hands a data source its options as strings, so the whole of it travels as one JSON
option, `sluice.source`, and is turned back into these types in `from_spark`, once.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from sluice.config import BackpressureConfig, Config, FieldType
from sluice.errors import ConfigError
from sluice.graph import KafkaSpec, StreamsSpec, log_spec

OPTION = "sluice.source"


@dataclass(frozen=True)
class FlowOptions:
    """Admission control of the stage that reads: its flow stage and the stages it signals,
    its backpressure settings and the trigger interval. `own_level`: measure this reader's own
    backlog, for a log that other stages read too."""

    backpressure: BackpressureConfig
    trigger_ms: int
    stage: str = "spark"
    upstreams: tuple[str, ...] = ("ingest",)
    inputs: tuple[str, ...] = ("events",)  # the streams it reads
    own_level: bool = False


@dataclass(frozen=True)
class SourceOptions:
    url: str  # the Redis that holds the slices, the flow state and the readers' offsets
    log: StreamsSpec | KafkaSpec
    format: str
    fields: tuple[tuple[str, str, bool], ...]  # (name, type, nullable)
    time_field: str | None
    max_events_per_batch: int | None
    max_string_bytes: int
    partition_events: int = 50_000
    max_partitions_per_shard: int = 8
    flow: FlowOptions | None = None  # None: no admission control beyond the static limit
    max_entry_bytes: int = 8_000_000  # a larger entry is one `oversize_entry` dead letter
    # Several queries may read the same shards, each with its own offsets ("" is the default
    # pipeline). A shard is trimmed (a Kafka group committed) only up to the slowest of its
    # `readers`, so they must name every reader of it: one left out may lose input it has not
    # read yet. A shard not listed has this reader alone.
    reader: str = ""
    readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The streaming query's checkpoint directory (on the driver host): a Kafka log keeps the
    # positions a fresh checkpoint started from there, so that a re-run first batch reads the
    # same records.
    checkpoint: str | None = None
    # Under a leadership lease (`pipeline.lease`): (the lease's key, this process's owner id).
    # The source plans no batch while another process holds that lease, so a leader that was
    # paused and lost it does not add to the shared offset log once it runs again.
    lease: tuple[str, str] | None = None
    # Whether the source releases a batch's input once Spark commits it. A fold that writes
    # behind (`pipeline.behind`) releases it itself, after the write.
    release: bool = True
    # A standby's query started ahead of a takeover (`source.arm`): the list its planner waits
    # on for `go` before Spark reads the checkpoint.
    armed: str | None = None
    # The decoder names (`_eid`) the events the fold will dead-letter as `future` (more than
    # `named_ahead_ms` after the batch's time) or may as `expired` (more than `named_behind_ms`
    # before it, the longest retention), as it names the events it flags itself, so that their
    # dead letters say where they are in the log. None: it names none of them.
    named_ahead_ms: int | None = None
    named_behind_ms: int | None = None

    def __post_init__(self) -> None:
        for shard, names in self.readers.items():
            if self.reader not in names:
                raise ConfigError(
                    f"source `reader` {self.reader!r} is not among the readers {list(names)} of"
                    f" shard {shard!r}; list every reader of a shard, this one included"
                )

    @property
    def shards(self) -> tuple[str, ...]:
        """The shard keys of a Redis stream (a Kafka topic's partitions are found at run time)."""
        return self.log.shards if isinstance(self.log, StreamsSpec) else ()

    def readers_of(self, shard: str) -> tuple[str, ...]:
        """Every reader of `shard`; `*` stands for every shard (a Kafka topic's partitions
        are only known at run time)."""
        return self.readers.get(shard) or self.readers.get("*") or (self.reader,)

    def to_spark(self) -> dict[str, str]:
        """Flatten to Spark's `option(k, v)` strings."""
        data = dataclasses.asdict(self)
        data["log"] = {"kind": "kafka" if isinstance(self.log, KafkaSpec) else "redis",
                       **data["log"]}  # fmt: skip
        if self.flow is not None:
            data["flow"]["backpressure"] = self.flow.backpressure.model_dump(mode="json")
        return {OPTION: json.dumps(data)}

    @classmethod
    def from_spark(cls, options: Any) -> SourceOptions:
        raw = options.get(OPTION)
        if raw is None:
            raise ConfigError(
                f"the Sluice source needs option `{OPTION}`;"
                " build it with SourceOptions.from_config(cfg, url).to_spark()"
            )
        data = json.loads(raw)
        log = data.pop("log")
        kind = log.pop("kind")
        if kind == "kafka":
            log["options"] = tuple(tuple(kv) for kv in log["options"])
            log["producer_options"] = tuple(tuple(kv) for kv in log["producer_options"])
            data["log"] = KafkaSpec(**log)
        else:
            data["log"] = StreamsSpec(tuple(log["shards"]))
        if data.get("flow") is not None:
            flow = data["flow"]
            flow["backpressure"] = BackpressureConfig.model_validate(flow["backpressure"])
            flow["upstreams"] = tuple(flow["upstreams"])
            flow["inputs"] = tuple(flow["inputs"])
            data["flow"] = FlowOptions(**flow)
        data["fields"] = tuple(tuple(f) for f in data["fields"])
        data["readers"] = {k: tuple(v) for k, v in data.get("readers", {}).items()}
        if data.get("lease") is not None:
            data["lease"] = tuple(data["lease"])
        return cls(**data)

    @classmethod
    def from_config(cls, cfg: Config, url: str) -> SourceOptions:
        """The source of `cfg`, read by the source's fold (`spark`)."""
        types: dict[str, FieldType] = cfg.source.field_types()
        ahead, behind = named_bounds(cfg)
        return cls(
            url=url,
            log=log_spec(cfg),
            format=cfg.source.format,
            fields=tuple((n, t.type, t.nullable) for n, t in types.items()),
            time_field=cfg.source.time_field,
            max_events_per_batch=cfg.source.max_events_per_batch,
            max_string_bytes=cfg.source.max_string_bytes,
            max_entry_bytes=cfg.source.max_entry_bytes,
            flow=FlowOptions(cfg.backpressure, cfg.spark.trigger, inputs=(cfg.source.stream,)),
            named_ahead_ms=ahead,
            named_behind_ms=behind,
        )


def named_bounds(cfg: Config) -> tuple[int, int | None]:
    """(`named_ahead_ms`, `named_behind_ms`) for the events of `cfg`: a `future` event is more
    than `source.max_future` ahead of its batch's time; an `expired` one is more than every
    retention behind it (its slice ends a retention or more before), so more than the longest."""
    return cfg.source.max_future, max((m.retention for m in cfg.metrics), default=None)
