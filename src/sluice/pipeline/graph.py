"""The pipeline as a graph of streams and stages (the `stages:` config), resolved for running.

    ingest ─▶ events ─┬─▶ [stage a] ─▶ a ─▶ [fold:a] ─▶ store
                      └─▶ [stage b] ─▶ b ─▶ [fold:b] ─▶ store
                      └─▶ [spark] ─▶ store          (metrics without `from`)

Every stream is a queue between the stage that writes it (`ingest` for the source) and the
stages that read it, each reader with its own offsets. A stream-to-stream stage is named by the
config; the stage that folds a stream into the slice store is `spark` for the source (as in a
pipeline without stages) and `fold:<stream>` for a stage's output. Backpressure follows these
edges (`flow_topology`): hop by hop, a stage signals only the writers of its input streams;
under `backpressure.propagation: source`, every stage signals the ingest tasks instead.

`graph_topology` needs only the config. A stage output without a declared `schema` gets the
schema of its SQL's result, which only Spark can tell: `resolve_schemas` asks it at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.config import (
    BackpressureConfig,
    Config,
    FieldType,
    MetricConfig,
    SourceConfig,
    StageConfig,
)
from sluice.errors import ConfigError
from sluice.flow.stages import INGEST, SPARK, STORE, Stage
from sluice.redis.keys import shard_keys

# The Spark types a stage's output may have, and the schema type each is written as.
SCHEMA_TYPES = {
    "string": "string",
    "bigint": "long",
    "int": "int",
    "smallint": "int",
    "tinyint": "int",
    "double": "double",
    "float": "float",
    "boolean": "boolean",
}


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
    """One stream: its shards, how its entries are encoded, and its readers' watermarks."""

    name: str
    writer: str  # the flow stage that writes it
    shards: tuple[str, ...]
    format: str
    schema: dict[str, str] | None  # None until resolve_schemas (a stage output without one)
    time_field: str | None
    backpressure: BackpressureConfig
    readers: tuple[str, ...] = ()  # flow stages that read it

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
            }
        )


@dataclass
class Graph:
    cfg: Config
    streams: dict[str, StreamSpec]
    stages: list[StageConfig]  # stream-to-stream stages, each after the writers of its inputs
    folds: dict[str, list[MetricConfig]]  # stream -> the metrics that fold it
    flow: dict[str, Stage] = field(default_factory=dict)

    def readers_of(self, stream: str) -> tuple[str, ...]:
        return tuple(reader_name(s) for s in self.streams[stream].readers)

    def fold_config(self, stream: str) -> Config:
        """The config of the pipeline folding `stream`: the stream as its source, its metrics,
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
    streams = {
        cfg.source.stream: StreamSpec(
            cfg.source.stream,
            INGEST,
            tuple(cfg.source.shard_keys()),
            cfg.source.format,
            dict(cfg.source.schema_),
            cfg.source.time_field,
            cfg.backpressure,
        )
    }
    ordered: list[StageConfig] = []
    pending = list(cfg.stages)
    while pending:  # the config is acyclic (checked on load), so every pass places one
        ready = [st for st in pending if all(s in streams for s in st.from_)]
        for st in ready:
            out = st.to
            streams[out.stream] = StreamSpec(
                out.stream,
                st.name,
                tuple(shard_keys(out.stream, out.shards, bool(cfg.source.hash_tags))),
                "jsonl",
                dict(out.schema_) if out.schema_ is not None else None,
                out.time_field,
                _watermarks(cfg, st),
            )
            ordered.append(st)
            pending.remove(st)
    folds: dict[str, list[MetricConfig]] = {}
    for m in cfg.metrics:
        folds.setdefault(m.from_ or cfg.source.stream, []).append(m)
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


def flow_topology(graph: Graph) -> dict[str, Stage]:
    """Flow stages by name. Each lists the stages it signals (its direct upstreams, or the
    ingest alone under `propagation: source`) and the streams that are its input queue."""
    cfg = graph.cfg
    heron = cfg.backpressure.propagation == "source"

    def ups(streams: list[str]) -> tuple[str, ...]:
        if heron:
            return (INGEST,)
        return tuple(dict.fromkeys(graph.streams[s].writer for s in streams))

    def shards(streams: list[str]) -> tuple[str, ...]:
        return tuple(k for s in streams for k in graph.streams[s].shards)

    out = {INGEST: Stage(INGEST, (), "none")}
    for st in graph.stages:
        out[st.name] = Stage(st.name, ups(st.from_), "streams", shards(st.from_))
    for s in graph.folds:
        fold = fold_stage(cfg, s)
        out[fold] = Stage(fold, ups([s]), "streams", shards([s]))
        store = store_stage(cfg, s)
        out[store] = Stage(store, (INGEST,) if heron else (fold,), "store")
    return out


def resolve_schemas(graph: Graph, spark: Any) -> Graph:
    """Fill in the schema of every stage output that declares none, from its SQL, and check
    each stage's SQL and each fold's metric fields. Raises ConfigError naming the field."""
    cfg = graph.cfg
    for i, st in enumerate(cfg.stages):
        if st not in graph.stages:
            continue
        inputs = [graph.streams[s] for s in st.from_]
        first = inputs[0]
        for j, other in enumerate(inputs[1:], start=1):
            if other.schema != first.schema or other.format != first.format:
                raise ConfigError(
                    f"stream {other.name!r} does not have the schema and format of"
                    f" {first.name!r}; one stage reads streams of one shape",
                    f"stages[{i}].from[{j}]",
                )
        assert first.schema is not None
        ddl = ", ".join(_column_ddl(n, t, n == first.time_field) for n, t in first.schema.items())
        session = spark.newSession()
        session.createDataFrame([], ddl).createOrReplaceTempView("input")
        load_tables(session, st, f"stages[{i}].tables")
        result = stage_sql(session, st, f"stages[{i}].sql")
        inferred = _schema_of(result, f"stages[{i}].sql")
        declared = graph.streams[st.to.stream].schema
        if declared is not None:
            for name in declared:
                if name not in inferred:
                    raise ConfigError(
                        f"the SQL's result has no column {name!r} (it has {', '.join(inferred)})",
                        f"stages[{i}].to.schema",
                    )
        schema = declared if declared is not None else inferred
        time_field = st.to.time_field
        if time_field is None and first.time_field in schema:
            time_field = first.time_field
        if time_field is not None and time_field not in schema:
            raise ConfigError(
                f"time_field {time_field!r} is not in the output ({', '.join(schema)})",
                f"stages[{i}].to.time_field",
            )
        graph.streams[st.to.stream] = dataclasses.replace(
            graph.streams[st.to.stream], schema=schema, time_field=time_field
        )
    for i, m in enumerate(cfg.metrics):
        spec = graph.streams[m.from_ or cfg.source.stream]
        assert spec.schema is not None
        for k in m.key:
            if k not in spec.schema:
                raise ConfigError(
                    f"key field {k!r} is not in stream {spec.name!r} ({', '.join(spec.schema)})",
                    f"metrics[{i}].key",
                )
    return graph


def _column_ddl(name: str, spec: str, is_time: bool) -> str:
    """A stage's input column: nullable as the schema says; the time field never is (a missing
    one is replaced by the entry's time before the SQL sees it)."""
    from sluice.source.decode import SPARK_TYPES

    t = FieldType.parse(spec)
    null = "" if t.nullable and not is_time else " NOT NULL"
    return f"`{name}` {SPARK_TYPES[t.type]}{null}"


def load_tables(session: Any, st: StageConfig, path: str) -> None:
    """Register the stage's static tables as views of `session` (read once, cached). Relative
    paths were made relative to the config file's directory when it was loaded."""
    for name, file in st.tables.items():
        p = Path(file)
        if not p.exists():
            raise ConfigError(f"table file {str(p)!r} not found", f"{path}.{name}")
        reader = session.read
        if p.suffix == ".csv":
            df = reader.option("header", "true").option("inferSchema", "true").csv(str(p))
        elif p.suffix == ".parquet":
            df = reader.parquet(str(p))
        else:
            df = reader.json(str(p))
        df.cache().createOrReplaceTempView(name)


def stage_sql(session: Any, st: StageConfig, path: str) -> Any:
    from pyspark.errors import AnalysisException, ParseException

    try:
        return session.sql(st.sql)
    except (AnalysisException, ParseException) as e:
        reason = str(e).strip().splitlines()[0]
        raise ConfigError(f"invalid Spark SQL {st.sql!r}: {reason}", path) from None


def _schema_of(df: Any, path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in df.schema.fields:
        kind = SCHEMA_TYPES.get(f.dataType.simpleString())
        if kind is None:
            raise ConfigError(
                f"column {f.name!r} has type {f.dataType.simpleString()}; a stage writes"
                f" {', '.join(sorted(set(SCHEMA_TYPES.values())))} (cast it, or explode it)",
                path,
            )
        if f.name.startswith("_") or f.name in out:
            raise ConfigError(f"column name {f.name!r} is reserved or repeated", path)
        out[f.name] = kind + ("?" if f.nullable else "")
    return out
