"""A one-batch streaming source of made-up events, for a standby's warm-up.

`spark.readStream.format("sluice-warm-up")` with the real source's options (so the same schema)
and `rows`, a JSON list of made-up decoded events: one micro-batch of them in two partitions,
then nothing. A fold's warm-up (`FoldQuery.warm_up`) runs its batch plan over it as a streaming
query to a throwaway checkpoint, so everything a takeover's first batch would do for the first
time is done before: the JVM loads the streaming classes, Spark starts the Python daemon that
plans a Python source's reads, and generates the plan's code for a streaming scan. Nothing is
read from the log and nothing is written to the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from sluice.source.options import SourceOptions
from sluice.source.values import output_schema, spark_schema_ddl

WARM_FORMAT = "sluice-warm-up"
ROWS_OPTION = "rows"
PARTITIONS = 2


class WarmUpSource(DataSource):
    """See the module docstring. Options: the Sluice source's, plus `rows`."""

    @classmethod
    def name(cls) -> str:
        return WARM_FORMAT

    def schema(self) -> str:
        return spark_schema_ddl(SourceOptions.from_spark(self.options))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        rows = orjson.loads(self.options[ROWS_OPTION])
        return WarmUpReader(SourceOptions.from_spark(self.options), rows)


class WarmUpReader(DataSourceStreamReader):
    def __init__(self, opts: SourceOptions, rows: list[dict[str, Any]]) -> None:
        self.opts, self.rows = opts, rows

    def initialOffset(self) -> dict[str, Any]:
        return {"batch": 0}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        return {"batch": 1}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if int(end["batch"]) <= int(start["batch"]):
            return []
        return [InputPartition(i) for i in range(PARTITIONS)]

    def commit(self, end: dict[str, Any]) -> None:
        pass

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        rows = self.rows[partition.value :: PARTITIONS]
        yield pa.RecordBatch.from_pylist(rows, schema=output_schema(self.opts))
