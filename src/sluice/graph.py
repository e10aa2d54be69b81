"""The pipeline as a graph of streams and stages, from the config alone (no Spark, no Redis).

    ingest ─▶ events ─┬─▶ [stage a] ─▶ a ─▶ [fold:a] ─▶ store:a
                      ├─▶ [stage b] ─▶ b ─▶ [fold:b] ─▶ store:b
                      └─▶ [spark] ─▶ store          (metrics without `from`)

Every stream is a queue between the stage that writes it (`ingest` for the source) and the
stages that read it, each reader with its own offsets. The source is a Redis stream or a Kafka
topic; stage outputs are always Redis streams. A stream-to-stream stage is named by the config;
the stage that folds a stream into the slice store is `spark` for the source and
`fold:<stream>` for a stage's output.

Backpressure follows these edges (`FlowStage.upstreams`): hop by hop, a stage signals only the
writers of its input streams; under `backpressure.propagation: source`, every stage signals the
ingest tasks instead (Heron-style). A stage without `stages:` in the config is the same graph
with one fold: ingest → spark → store.

A stage output without a declared `schema` gets the schema of its SQL's result, which only Spark
can tell: `pipeline.schemas.resolve_schemas` fills it in at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from sluice.config import BackpressureConfig, Config, MetricConfig, SourceConfig, StageConfig
from sluice.logs import Repeats
from sluice.redis.keys import shard_keys

INGEST = "ingest"
SPARK = "spark"
STORE = "store"
ALL_SHARDS = "*"  # the readers of every shard of a log (a Kafka topic's partitions vary)
# librdkafka's log lines: each failed try of each broker connection is a line, thousands in a
# second when a broker is out of reach; one of a kind every 10 s says it.
KAFKA_LOG = logging.getLogger("sluice.kafka")
KAFKA_LOG.addFilter(Repeats())


@dataclass(frozen=True)
class FlowStage:
    """A stage as backpressure sees it: the stages it signals when overloaded, what its queue
    is (`streams`: its input streams; `store`: the slice store; `none`: producers), and the
    names of its input streams."""

    name: str
    upstreams: tuple[str, ...]
    queue: str  # "streams" | "store" | "none"
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class StreamsSpec:
    """Redis Streams: the shard keys, in the Redis of `SourceOptions.url`."""

    shards: tuple[str, ...]


@dataclass(frozen=True)
class KafkaSpec:
    """A Kafka topic: its partitions are the shards. `options` go to librdkafka as they are."""

    bootstrap: str
    topic: str
    group_id: str
    start: str = "earliest"  # where a fresh checkpoint begins: earliest | latest
    options: tuple[tuple[str, str], ...] = ()
    producer_options: tuple[tuple[str, str], ...] = ()

    def client_config(self, **extra: Any) -> dict[str, Any]:
        """A librdkafka config: the bootstrap servers, the user's options, then `extra`.
        librdkafka's own log lines go to the `sluice.kafka` logger (key=value lines, like
        every other log line), not straight to stderr."""
        return {
            "bootstrap.servers": self.bootstrap,
            "logger": KAFKA_LOG,
            **dict(self.options),
            **extra,
        }


def log_spec(cfg: Config) -> StreamsSpec | KafkaSpec:
    """The log of `cfg.source`: its Kafka topic when `source.kafka` is set, else its streams."""
    k = cfg.source.kafka
    if k is None:
        return StreamsSpec(tuple(cfg.source.shard_keys()))
    return KafkaSpec(
        bootstrap=k.bootstrap,
        topic=k.topic,
        group_id=k.group_id,
        start=k.start,
        options=_librdkafka(k.options),
        producer_options=_librdkafka(k.producer_options),
    )


def _librdkafka(options: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Settings as librdkafka takes them: strings, booleans as `true` / `false`."""
    return tuple(
        (str(k), str(v).lower() if isinstance(v, bool) else str(v)) for k, v in options.items()
    )


def fold_stage(cfg: Config, stream: str) -> str:
    """The flow stage that folds `stream` into the slice store."""
    return SPARK if stream == cfg.source.stream else f"fold:{stream}"


def store_stage(cfg: Config, stream: str) -> str:
    return STORE if stream == cfg.source.stream else f"{STORE}:{stream}"


def reader_name(stage: str) -> str:
    """The reader name a stage's offsets are kept under ("" for the source's fold, which is the
    single reader of a pipeline without stages)."""
    return "" if stage == SPARK else stage


@dataclass(frozen=True)
class StreamSpec:
    """One stream: its log (shards of a Redis stream, or a Kafka topic), how its entries are
    encoded, its readers' watermarks, and the stages that read it."""

    name: str
    writer: str  # the flow stage that writes it
    log: StreamsSpec | KafkaSpec
    format: str
    schema: dict[str, str] | None  # None until resolved (a stage output without one)
    time_field: str | None
    backpressure: BackpressureConfig
    readers: tuple[str, ...] = ()  # flow stages that read it

    @property
    def shards(self) -> tuple[str, ...]:
        """Its Redis shard keys (a Kafka topic has none known before it is read)."""
        return self.log.shards if isinstance(self.log, StreamsSpec) else ()

    def source_config(self, base: SourceConfig) -> SourceConfig:
        """This stream as a `source:` section (the fold of a stage's output reads it so)."""
        assert self.schema is not None, f"stream {self.name!r} has no schema yet"
        return base.model_copy(
            update={
                "stream": self.name,
                "shards": len(self.shards),
                "format": self.format,
                "schema_": dict(self.schema),
                "time_field": self.time_field,
                "kafka": None,
            }
        )


@dataclass
class Graph:
    cfg: Config
    streams: dict[str, StreamSpec]
    stages: list[StageConfig]  # stream-to-stream stages, each after the writers of its inputs
    folds: dict[str, list[MetricConfig]]  # stream -> the metrics that fold it
    flow: dict[str, FlowStage] = field(default_factory=dict)

    def readers_of(self, stream: str) -> tuple[str, ...]:
        return tuple(reader_name(s) for s in self.streams[stream].readers)

    def shard_readers(self, inputs: list[str]) -> dict[str, tuple[str, ...]]:
        """The readers of each shard of `inputs` (`ALL_SHARDS` for a Kafka topic)."""
        out: dict[str, tuple[str, ...]] = {}
        for s in inputs:
            spec = self.streams[s]
            for shard in spec.shards or (ALL_SHARDS,):
                out[shard] = self.readers_of(s)
        return out

    def fold_config(self, stream: str) -> Config:
        """The config of the query folding `stream`: the stream as its source, its metrics,
        and the stream's watermarks."""
        spec = self.streams[stream]
        if stream == self.cfg.source.stream:
            return self.cfg.model_copy(update={"metrics": self.folds[stream], "stages": []})
        return self.cfg.model_copy(
            update={
                "source": spec.source_config(self.cfg.source),
                "metrics": self.folds[stream],
                "derived": [],
                "stages": [],
                "backpressure": spec.backpressure,
            }
        )


def _watermarks(cfg: Config, st: StageConfig) -> BackpressureConfig:
    if st.to.high_watermark is None:
        return cfg.backpressure
    return cfg.backpressure.model_copy(
        update={"high_watermark": st.to.high_watermark, "low_watermark": st.to.low_watermark}
    )


def graph_topology(cfg: Config) -> Graph:
    """The streams, stages and folds of `cfg`, in an order where every writer comes first."""
    src = cfg.source
    streams = {
        src.stream: StreamSpec(
            src.stream, INGEST, log_spec(cfg), src.format, dict(src.schema_), src.time_field,
            cfg.backpressure,
        )
    }  # fmt: skip
    ordered: list[StageConfig] = []
    pending = list(cfg.stages)
    while pending:  # the config is acyclic (checked on load), so every pass places one
        ready = [st for st in pending if all(s in streams for s in st.from_)]
        for st in ready:
            out = st.to
            streams[out.stream] = StreamSpec(
                out.stream,
                st.name,
                StreamsSpec(tuple(shard_keys(out.stream, out.shards, bool(src.hash_tags)))),
                "jsonl",
                dict(out.schema_) if out.schema_ is not None else None,
                out.time_field,
                _watermarks(cfg, st),
            )
            ordered.append(st)
            pending.remove(st)
    folds: dict[str, list[MetricConfig]] = {}
    for m in cfg.metrics:
        folds.setdefault(m.from_ or src.stream, []).append(m)
    readers: dict[str, list[str]] = {name: [] for name in streams}
    for st in ordered:
        for s in st.from_:
            readers[s].append(st.name)
    for s in folds:
        readers[s].append(fold_stage(cfg, s))
    for name, rs in readers.items():
        streams[name] = dataclasses.replace(streams[name], readers=tuple(rs))
    graph = Graph(cfg, streams, ordered, folds)
    graph.flow = flow_topology(graph)
    return graph


def flow_topology(graph: Graph) -> dict[str, FlowStage]:
    """Flow stages by name. Each lists the stages it signals (its direct upstreams, or the
    ingest alone under `propagation: source`) and the streams that are its input queue."""
    cfg = graph.cfg
    heron = cfg.backpressure.propagation == "source"

    def ups(streams: list[str]) -> tuple[str, ...]:
        if heron:
            return (INGEST,)
        return tuple(dict.fromkeys(graph.streams[s].writer for s in streams))

    out = {INGEST: FlowStage(INGEST, (), "none")}
    for st in graph.stages:
        out[st.name] = FlowStage(st.name, ups(st.from_), "streams", tuple(st.from_))
    for s in graph.folds:
        fold = fold_stage(cfg, s)
        out[fold] = FlowStage(fold, ups([s]), "streams", (s,))
        store = store_stage(cfg, s)
        out[store] = FlowStage(store, (INGEST,) if heron else (fold,), "store")
    return out
