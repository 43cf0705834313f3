"""The start-up ownership check: one group delivers a topic into a shard at a time.

Run by ``preflight`` before the Spark session starts; nothing is written unless every
check passes. For each topic of the job (patterns resolved against the cluster's
topics at start) and its shard:

1. the ownership record (``aggregator.kafka.ownership``) decides: the job's group
   owns the key (go on, nothing written), nobody does (claim it), another group does
   (refused, :class:`TopicOwned`, unless ``job.take_over_from`` names it);
2. for a claim or a take-over, the shard must not already store rows of the offsets
   the start would deliver anew (:func:`delivers_from`: after the blocks a commit
   lists, or the default start for a partition without commit). This catches the
   groups that delivered before ownership was recorded (``RowsAlreadyStored``);
3. a take-over copies the previous owner's commits (offset and metadata, verbatim)
   into the job's group, in the same Kafka transaction as the new record, so the new
   group replays the owner's unfinished blocks identically and continues where it
   stopped. The previous owner's job must be stopped (its lock group empty).

A restart by the owner skips 2: its own commits and the protocol guard its replays.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from blockagg import logs
from blockagg.aggregator.clickhouse.exceptions import RowsAlreadyStored
from blockagg.aggregator.clickhouse.stored import (
    coordinate_tables,
    overlaps,
    stored_top,
)
from blockagg.aggregator.core.exceptions import MetadataDecodeError
from blockagg.aggregator.core.metadata import decode, is_blockagg
from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.kafka.exceptions import ClaimRaced, TopicOwned
from blockagg.aggregator.kafka.ownership import (
    ClaimKey,
    Decision,
    OwnersStore,
    decide,
    shard_identity,
)
from blockagg.config import Config, TopicConfig
from blockagg.spark.offsets import TopicPartition, make_consumer, read_committed, watermarks

log = logs.get("ownership")

ATTEMPTS = 3


def delivers_from(commit: Committed | None, default: int) -> int:
    """The first offset a start delivers anew: after every block the commit lists
    (those are replayed, identical, and deduplicated), else the resume offset; a
    partition without commit starts at ``default``."""
    if commit is None:
        return default
    text = commit.metadata.rstrip("\x00")
    if is_blockagg(text):
        try:
            metadata = decode(text)
        except MetadataDecodeError:
            return commit.offset  # refused later, with its own message
        if metadata.resume == commit.offset:
            return max([commit.offset, *(b.last + 1 for b in metadata.blocks)])
    return commit.offset


def _commits(config: Config, group: str, partitions: Sequence[TopicPartition]
             ) -> dict[TopicPartition, Committed]:
    consumer = make_consumer(config.kafka.librdkafka_config(), group)
    try:
        return read_committed(consumer, partitions)
    finally:
        consumer.close()


def _watermarks(config: Config, partitions: Sequence[TopicPartition]
                ) -> dict[TopicPartition, tuple[int, int]]:
    consumer = make_consumer(config.kafka.librdkafka_config(),
                             config.job.metadata_group_id)
    try:
        return watermarks(consumer, partitions)
    finally:
        consumer.close()


def _check_stopped(config: Config, group: str) -> None:
    """A take-over needs the previous owner's job stopped (no lock member left)."""
    from confluent_kafka.admin import AdminClient

    from blockagg.spark.lock import _describe

    admin = AdminClient(logs.kafka_client_config(config.kafka.librdkafka_config()))
    for name in (f"{group}.lock", group):
        try:
            members = list(getattr(_describe(admin, name), "members", []) or [])
        except Exception as exc:  # a group that never existed has no member
            log.debug("describe of %s failed: %s", name, exc)
            continue
        if members:
            shown = ", ".join(f"{m.client_id}@{m.host}" for m in members)
            raise TopicOwned(
                f"--take-over {group}: group {name!r} still has members ({shown}): the job "
                f"of {group} is running. Stop it first, then start this one again")


def _stored_conflicts(config: Config, topic: str, shard: TopicConfig,
                      starts: Mapping[int, int], registered: Sequence[str]
                      ) -> dict[int, tuple[int, str]]:
    from clickhouse_driver import Client

    from blockagg.tls import tls_arguments

    ch = config.clickhouse
    tls = tls_arguments(ch.secure, ch.verify, ch.ca_certs)
    timeout = min(10.0, ch.connect_timeout)
    error: Exception | None = None
    incarnation = None
    if ch.shared_with_other_kafka_clusters:  # another cluster's rows are not this topic's
        from blockagg.aggregator.kafka.incarnation import TopicIncarnations

        incarnation = TopicIncarnations(config.kafka.librdkafka_config()).of(topic)
    for replica in shard.replicas:  # any replica: quorum inserts are on each
        client = Client(replica.host, port=replica.port, user=ch.user,
                        password=ch.password.reveal(), connect_timeout=timeout,
                        send_receive_timeout=max(timeout, 60.0), **tls)
        try:
            tables = coordinate_tables(client, registered)
            return overlaps(starts, stored_top(client, topic, tables,
                                               config.dead_letters.table, incarnation))
        except Exception as exc:
            error = exc
        finally:
            client.disconnect()
    raise RowsAlreadyStored(
        f"could not read which offsets of {topic} shard {shard_identity(shard.replicas)} "
        f"stores: {str(error).splitlines()[0] if error else 'no replica'}; the start is "
        "refused rather than risk storing them twice. Check the replicas")


def _registered_tables(config: Config) -> list[str]:
    """The tables the job can route to: every table of the schema registry."""
    from blockagg.aggregator.kafka.log_store import from_config

    return sorted(from_config(config).current().tables().values())


def _rows_message(topic: str, shard: str, group: str,
                  found: Mapping[int, tuple[int, str]], starts: Mapping[int, int],
                  shared: bool = False) -> str:
    shown = ", ".join(f"[{p}] rows up to offset {o} in {t} (would deliver from {starts[p]})"
                      for p, (o, t) in sorted(found.items()))
    resets = " ".join(f"--topic {topic}:{p} --to-offset {o + 1}"
                      for p, (o, _) in sorted(found.items()))
    return (
        f"topic {topic}: shard {shard} already stores rows of the offsets group {group!r} "
        f"would deliver ({shown}): they would be stored twice. Restart with the group that "
        "delivered them (--group), or take over from it deliberately (--take-over GROUP), "
        f"or start after what is stored (kafka-consumer-groups.sh --reset-offsets --group "
        f"{group} {resets} --execute)"
        + ("" if shared else "; if another Kafka cluster feeds these tables under the same "
           "topic name, set clickhouse.shared_with_other_kafka_clusters = true"))


def check(config: Config, topics: Mapping[str, int], clickhouse: bool = True,
          run: str = "") -> list[Decision]:
    """The ownership check of a start (module doc); retried when a concurrent start
    changed a record in between (the second pass reads the winner's record)."""
    for attempt in range(ATTEMPTS):
        try:
            return _check_once(config, topics, clickhouse, run)
        except ClaimRaced:
            if attempt + 1 == ATTEMPTS:
                raise
            logs.event(log, "ownership record changed during the start; checking again")
    raise AssertionError("unreachable")


def _check_once(config: Config, topics: Mapping[str, int], clickhouse: bool,
                run: str) -> list[Decision]:
    group = config.job.metadata_group_id
    take = config.job.take_over_from
    store = OwnersStore(config.kafka.librdkafka_config(), config.job.owners_topic)
    cluster = store.cluster_id()
    records = store.read()
    now_ms = int(time.time() * 1000)
    registered: list[str] | None = None  # the registry's tables, read when needed
    decisions: list[Decision] = []
    copies: list[tuple[str, int, int, str]] = []
    for topic in sorted(t for t in topics if any(c.matches(t) for c in config.topics)):
        shard = config.topic_for(topic)
        key = ClaimKey(cluster, topic, shard_identity(shard.replicas))
        current = records.get(key)
        partitions = [(topic, p) for p in range(topics[topic])]
        other = (current.owner if current is not None and current.owner != group
                 else take if current is None else "")
        other_commits = _commits(config, other, partitions) if other else {}
        decision = decide(key, current, group, take, now_ms, run,
                          {p: c.offset for (_, p), c in other_commits.items()})
        decisions.append(decision)
        if decision.kind == "owner":
            continue
        if decision.kind == "take_over":
            _check_stopped(config, decision.from_group)
        own = _commits(config, group, partitions)
        commits = {**own, **other_commits} if decision.kind == "take_over" else own
        if decision.kind == "take_over":
            copies += [(t, p, c.offset, c.metadata) for (t, p), c in other_commits.items()]
        if clickhouse:
            marks = _watermarks(config, partitions)
            default = 0 if config.job.starting_offsets == "earliest" else 1
            starts = {p: delivers_from(commits.get((t, p)), marks[(t, p)][default])
                      for t, p in partitions}
            if registered is None:
                registered = _registered_tables(config)
            found = _stored_conflicts(config, topic, shard, starts, registered)
            if found:
                raise RowsAlreadyStored(_rows_message(
                    topic, key.shard, group, found, starts,
                    config.clickhouse.shared_with_other_kafka_clusters))
    writes = [d for d in decisions if d.record is not None]
    if writes:
        store.write(writes, {group: copies})
    for d in decisions:
        logs.event(log, "ownership", topic=d.key.topic, shard=d.key.shard, group=group,
                   decision=d.kind, from_group=d.from_group or None)
    return decisions
