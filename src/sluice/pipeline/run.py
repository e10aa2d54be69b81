"""Everything `sluice run` runs: one streaming query per stage of the graph, supervised.

A config without `stages:` is one query, the source's fold, exactly as before stages existed.
With stages, every stream-to-stream stage and every stream folded by metrics is its own query in
the same Spark application (each with its own checkpoint, reader offsets, writer tokens and
batch records), and one supervisor restarts whichever fails.
"""

from __future__ import annotations

import re
from typing import Any

from pyspark.sql import SparkSession

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import ConfigError
from sluice.pipeline.graph import (
    Graph,
    fold_stage,
    graph_topology,
    reader_name,
    resolve_schemas,
    store_stage,
)
from sluice.pipeline.job import Pipeline, Role
from sluice.pipeline.stage import StreamStage
from sluice.pipeline.supervisor import Part, Supervisor
from sluice.redis.connection import RedisHandle


def role_of(graph: Graph, stage: str, inputs: list[str], store: str | None = None) -> Role:
    readers = {shard: graph.readers_of(s) for s in inputs for shard in graph.streams[s].shards}
    return Role(
        graph.flow[stage],
        reader_name(stage),
        readers,
        graph.flow[store] if store is not None else None,
    )


def build_parts(
    cfg: Config,
    redis: RedisHandle,
    spark: SparkSession,
    clock: Clock = SYSTEM_CLOCK,
    only: tuple[str, ...] = (),
    **hooks: Any,
) -> tuple[Graph, list[Part]]:
    """The graph, resolved against Spark, and its queries (stages first, then the folds); with
    `only`, just the queries named there (other applications run the rest). `hooks` go to every
    fold (`Pipeline`'s test hooks)."""
    graph = resolve_schemas(graph_topology(cfg), spark)
    queries = [st.name for st in graph.stages] + [fold_stage(cfg, s) for s in graph.folds]
    unknown = [n for n in only if n not in queries]
    if unknown:
        raise ConfigError(
            f"--stage: no query named {', '.join(unknown)}; this config has {', '.join(queries)}"
        )
    parts: list[Part] = []
    for st in graph.stages:
        if only and st.name not in only:
            continue
        role = role_of(graph, st.name, st.from_)
        parts.append(StreamStage(cfg, graph, st, role, redis, spark, clock))
    for stream in graph.folds:
        name = fold_stage(cfg, stream)
        if only and name not in only:
            continue
        role = role_of(graph, name, [stream], store_stage(cfg, stream))
        try:
            parts.append(
                Pipeline(graph.fold_config(stream), redis, spark, clock, role=role, **hooks)
            )
        except ConfigError as e:
            raise _config_path(cfg, graph, stream, e) from None
    return graph, parts


def _config_path(cfg: Config, graph: Graph, stream: str, e: ConfigError) -> ConfigError:
    """A fold's config lists only its own metrics: name the metric as the user's file does."""
    m = re.match(r"metrics\[(\d+)\](.*)", e.path)
    if m is None:
        return e
    metric = graph.folds[stream][int(m.group(1))]
    i = cfg.metrics.index(metric)
    message = str(e).split(": ", 1)[1] if str(e).startswith("config error") else str(e)
    return ConfigError(message, f"metrics[{i}]{m.group(2)}")


class Run:
    """The running graph: `run_forever()` until `request_stop()`, then every query stops."""

    def __init__(
        self,
        cfg: Config,
        redis: RedisHandle,
        spark: SparkSession,
        clock: Clock = SYSTEM_CLOCK,
        only: tuple[str, ...] = (),
    ) -> None:
        self.graph, self.parts = build_parts(cfg, redis, spark, clock, only)
        self.supervisor = Supervisor(self.parts, redis.client, clock)

    def run_forever(self) -> None:
        self.supervisor.run_forever()

    def request_stop(self) -> None:
        self.supervisor.request_stop()
