"""The producer's writes to a Kafka topic (`source.producer`)."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Producer as KafkaProducer

from sluice.errors import SluiceError
from sluice.graph import KafkaSpec
from sluice.source.kafka_records import topic_partitions

DELIVERY_TIMEOUT_S = 30.0


class KafkaSink:
    """Writes records to a Kafka topic and waits for every delivery (librdkafka retries on
    its own; with idempotence on by default, a retry neither repeats nor reorders)."""

    def __init__(self, spec: KafkaSpec) -> None:
        self.spec = spec
        self._producer: Any = None

    def _client(self) -> Any:
        if self._producer is None:
            defaults = {"enable.idempotence": True, "linger.ms": 5}
            config = self.spec.client_config(**dict(self.spec.producer_options))
            self._producer = KafkaProducer({**defaults, **config})
        return self._producer

    def partitions(self) -> int:
        """The topic's partition count. Raises LogUnavailable when the topic cannot be found."""
        return len(topic_partitions(self._client(), self.spec, 10.0))

    def write(self, records: list[tuple[int, bytes, bytes | None]]) -> None:
        """Produce every record and wait until each is delivered. Raises SluiceError naming
        the first failure when any was not (the caller keeps the events)."""
        producer = self._client()
        errors: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        for partition, value, key in records:
            while True:
                try:
                    producer.produce(
                        self.spec.topic, value, key, partition=partition, on_delivery=delivered
                    )
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.1)
        left = producer.flush(DELIVERY_TIMEOUT_S)
        if left:
            errors.append(f"{left} records still undelivered after {DELIVERY_TIMEOUT_S:.0f}s")
        if errors:
            raise SluiceError(
                f"{len(errors)} of {len(records)} records to Kafka topic {self.spec.topic!r}"
                f" were not delivered: {errors[0]}"
            )
