"""Ending a hanging transaction on the metadata group at start (``kafka.hanging``).

The plan is pure (:func:`~blockagg.aggregator.kafka.hanging.plan_heal`); this module
gathers what it needs and runs it. Three of the calls exist only in Kafka's own Admin
client (KIP-664: DescribeProducers, DescribeTransactions, AbortTransaction), not in
librdkafka, so :class:`JavaAdmin` reaches the Java client the driver already holds for
Spark's Kafka source, through py4j, with the same settings as the source
(``KafkaConfig.spark_source_options``: security included). Only the driver heals: it
runs before any task, under the group's lock, so nothing else commits for the group
meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from blockagg import logs
from blockagg.aggregator.kafka.fencing import FencedAttempt, transactional_id
from blockagg.aggregator.kafka.hanging import (
    OFFSETS_TOPIC,
    Abort,
    CoordinatorView,
    HealPlan,
    OpenTransaction,
    Recommit,
    offsets_partition,
    plan_heal,
    read_records,
)
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from blockagg.aggregator.kafka.offsets_codec import OffsetCommit
from blockagg.config import Config

log = logs.get("metadata")

ADMIN_TIMEOUT_S: Final = 30


class JavaAdmin:
    """Kafka's Java ``Admin`` client, through py4j, for the transaction calls."""

    def __init__(self, jvm: Any, properties: Mapping[str, str],
                 timeout_s: int = ADMIN_TIMEOUT_S) -> None:
        self._jvm = jvm
        self._timeout_s = timeout_s
        props = jvm.java.util.Properties()
        for key, value in properties.items():
            props.setProperty(key, value)
        props.setProperty("default.api.timeout.ms", str(timeout_s * 1000))
        self._admin = jvm.org.apache.kafka.clients.admin.Admin.create(props)

    def _get(self, future: Any) -> Any:
        return future.get(self._timeout_s, self._jvm.java.util.concurrent.TimeUnit.SECONDS)

    def _partition(self, partition: int) -> Any:
        return self._jvm.org.apache.kafka.common.TopicPartition(OFFSETS_TOPIC, partition)

    def open_transactions(self, partition: int) -> list[OpenTransaction]:
        """The producers with a transaction open on ``__consumer_offsets-partition``."""
        wanted = self._jvm.java.util.ArrayList()
        wanted.add(self._partition(partition))
        states = self._get(self._admin.describeProducers(wanted).all())
        found: list[OpenTransaction] = []
        for state in states.get(self._partition(partition)).activeProducers():
            start = state.currentTransactionStartOffset()
            if not start.isPresent():
                continue
            epoch = state.coordinatorEpoch()
            found.append(OpenTransaction(
                producer_id=int(state.producerId()), epoch=int(state.producerEpoch()),
                coordinator_epoch=int(epoch.getAsInt()) if epoch.isPresent() else -1,
                start_offset=int(start.getAsLong())))
        return found

    def describe(self, ids: Iterable[str]) -> dict[str, CoordinatorView | None]:
        """The coordinator's view of each transactional id; ``None`` if it knows none."""
        wanted = sorted(set(ids))
        if not wanted:
            return {}
        names = self._jvm.java.util.ArrayList()
        for tid in wanted:
            names.add(tid)
        result = self._admin.describeTransactions(names)
        views: dict[str, CoordinatorView | None] = {}
        for tid in wanted:
            try:
                d = self._get(result.description(tid))
            except Exception as exc:  # py4j's Py4JJavaError, carrying the Java one
                if "TransactionalIdNotFound" in str(exc):
                    views[tid] = None
                    continue
                raise
            views[tid] = CoordinatorView(
                state=str(d.state().toString()), producer_id=int(d.producerId()),
                epoch=int(d.producerEpoch()),
                partitions=frozenset((str(tp.topic()), int(tp.partition()))
                                     for tp in d.topicPartitions()))
        return views

    def abort(self, step: Abort) -> None:
        """Write the abort marker that ends ``step``'s open transaction."""
        spec = self._jvm.org.apache.kafka.clients.admin.AbortTransactionSpec(
            self._partition(step.partition), step.producer_id,
            self._jvm.java.lang.Short.valueOf(str(step.epoch)), step.coordinator_epoch)
        self._get(self._admin.abortTransaction(spec).all())

    def close(self) -> None:
        self._admin.close()


def java_properties(config: Config) -> dict[str, str]:
    """The Java client settings of Spark's source, without the ``kafka.`` prefix."""
    return {k[len("kafka."):]: v for k, v in config.kafka.spark_source_options().items()}


def heal_hanging(config: Config, jvm: Any, *, admin: JavaAdmin | None = None) -> HealPlan:
    """Find the hanging transactions of the job's metadata group, plan their end and
    run it (every re-commit, then every abort); one log line per step. Returns the plan:
    ``plan.complete`` says whether the group's stable reads should work again."""
    from confluent_kafka import Consumer

    group = config.job.metadata_group_id
    settings: dict[str, Any] = dict(config.kafka.librdkafka_config())
    probe = Consumer(logs.kafka_client_config(
        {**settings, "group.id": group, "enable.auto.commit": False}))
    try:
        topic = probe.list_topics(OFFSETS_TOPIC, timeout=ADMIN_TIMEOUT_S).topics[OFFSETS_TOPIC]
        partition = offsets_partition(group, len(topic.partitions))
    finally:
        probe.close()
    admin = admin or JavaAdmin(jvm, java_properties(config))
    try:
        open_transactions = admin.open_transactions(partition)
        records = read_records(settings, partition, [t.start_offset for t in open_transactions])
        ids = {transactional_id(group, r.key.topic, r.key.partition)
               for r in records.values() if isinstance(r, OffsetCommit) and r.key.group == group}
        plan = plan_heal(group, partition, open_transactions, records, admin.describe(ids),
                         transactional_id)
        store = KafkaMetadataStore({**settings, "group.id": group, "enable.auto.commit": False})
        try:
            for step in plan.steps:
                if isinstance(step, Recommit):
                    with FencedAttempt(store, step.topic, step.partition) as attempt:
                        attempt.commit(step.topic, step.partition, step.offset, step.metadata)
                    logs.event(log, "hanging intent re-committed", level=30,
                               partition=f"{step.topic}[{step.partition}]",
                               offset=step.offset,
                               hanging=f"{OFFSETS_TOPIC}-{partition}@{step.start_offset}")
                else:
                    admin.abort(step)
                    logs.event(log, "hanging transaction aborted", level=30,
                               hanging=f"{OFFSETS_TOPIC}-{partition}@{step.start_offset}",
                               producer_id=step.producer_id, epoch=step.epoch)
        finally:
            store.close()
        for item in plan.left:
            logs.event(log, "open transaction left alone", level=30 if item.blocks else 20,
                       hanging=f"{OFFSETS_TOPIC}-{partition}@{item.start_offset}",
                       producer_id=item.producer_id, reason=item.reason)
        return plan
    finally:
        admin.close()
