"""What only Spark can tell about the graph: the schema of a stage's SQL result, checked and
filled in at start-up, and the static tables a stage joins."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sluice.config import FieldType, StageConfig
from sluice.errors import ConfigError
from sluice.graph import Graph
from sluice.source.values import SPARK_TYPES

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
    t = FieldType.parse(spec)
    null = "" if t.nullable and not is_time else " NOT NULL"
    return f"`{name}` {SPARK_TYPES[t.type]}{null}"


# CSV as RFC 4180 and the common writers (pandas, Python's csv, spreadsheets) quote it: a `"`
# inside a quoted field is written twice (Spark's own default escapes it with a backslash).
CSV_OPTIONS = {"header": "true", "escape": '"'}


def load_tables(session: Any, st: StageConfig, path: str) -> None:
    """Register the stage's static tables as views of `session` (read once, cached). Relative
    paths were made relative to the config file's directory when it was loaded."""
    for name, file in st.tables.items():
        p = Path(file)
        if not p.exists():
            raise ConfigError(f"table file {str(p)!r} not found", f"{path}.{name}")
        reader = session.read
        if p.suffix == ".csv":
            df = reader.options(**CSV_OPTIONS, inferSchema="true").csv(str(p))
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
