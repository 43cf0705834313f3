"""One group per topic and shard: the ownership record (invariant 8).

Two metadata groups delivering one topic into one shard each store every message
(their blocks differ, so ClickHouse's deduplication does not drop the second copy).
Who delivers is therefore recorded in Kafka, in a compacted topic of the registry's
family (default ``_blockagg_owners``, one partition), one record per
:class:`ClaimKey` = (Kafka cluster id, topic, shard). The shard is the set of its
ClickHouse replicas, ``host:port`` lower-cased and sorted (:func:`shard_identity`):
the same replicas listed in another order are the same shard. A record (JSON) names
the owning group and keeps the last :data:`HISTORY_KEPT` claims and take-overs (who,
from which group, from which offsets), so compaction, which keeps only a key's last
record, never loses who owns the key.

What a start may do is a pure function of the key's record (:func:`decide`): no
record, claim it; owned by the job's group, go on (nothing written); owned by another
group, refuse (:class:`TopicOwned`, naming the owner, what it delivered and the ways
on), unless ``job.take_over_from`` names that owner.

**The race.** Every write to the topic is a Kafka transaction of one transactional id
per ownership topic (:func:`owners_transactional_id`): a writer initialises the id
(which fences every earlier writer and ends its open transaction), *then* reads the
topic to its end, checks that each record it is about to replace is still the one it
decided on (compare and set), writes and commits. A commit succeeds only if no other
writer initialised the id since this one did, so no other claim was committed between
this writer's read and its commit: of two jobs claiming at once, the one fenced
retries, reads the winner's record, and is refused. With one id for the whole topic
no other transaction is ever open when the fenced read runs, so a ``read_committed``
read to the high watermark sees every committed claim (per-key ids would leave another
key's open transaction holding the last stable offset below a committed record).
Writes are rare (a first claim, a take-over): a restart of the owner writes nothing.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from blockagg import logs
from blockagg.aggregator.kafka.exceptions import (
    ClaimRaced,
    OwnershipStoreError,
    TopicOwned,
)

log = logs.get("ownership")

DEFAULT_TOPIC: Final = "_blockagg_owners"
HISTORY_KEPT: Final = 20
FORMAT: Final = 1
CLAIM_ATTEMPTS: Final = 5


def shard_identity(replicas: Iterable[object]) -> str:
    """A shard as its ClickHouse replicas: ``host:port`` lower-cased, sorted, joined
    by commas (``ch1:9000,ch2:9000``)."""
    return ",".join(sorted({str(r).strip().lower() for r in replicas}))


@dataclass(frozen=True, order=True)
class ClaimKey:
    cluster: str
    topic: str
    shard: str

    def encode(self) -> bytes:
        """A JSON array: unambiguous whatever the names contain."""
        return json.dumps([self.cluster, self.topic, self.shard],
                          separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> ClaimKey:
        cluster, topic, shard = json.loads(raw)
        return ClaimKey(str(cluster), str(topic), str(shard))


@dataclass(frozen=True)
class Handover:
    """One claim of the key: ``group`` took it ``from_group`` ("" for a first claim)
    at ``offsets`` (partition -> the from-group's committed resume offset, copied to
    ``group``)."""

    group: str
    from_group: str
    at_ms: int
    offsets: tuple[tuple[int, int], ...] = ()
    run: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"group": self.group, "from_group": self.from_group, "at_ms": self.at_ms,
                "offsets": {str(p): o for p, o in self.offsets}, "run": self.run}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Handover:
        return Handover(str(obj["group"]), str(obj.get("from_group", "")), int(obj["at_ms"]),
                        tuple(sorted((int(p), int(o))
                                     for p, o in dict(obj.get("offsets", {})).items())),
                        str(obj.get("run", "")))


@dataclass(frozen=True)
class Claim:
    key: ClaimKey
    owner: str
    history: tuple[Handover, ...] = field(default=())

    @property
    def since_ms(self) -> int:
        return self.history[-1].at_ms if self.history else 0

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "owner": self.owner,
                           "history": [h.as_json() for h in self.history]},
                          sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def decode(key: bytes, value: bytes) -> Claim:
        try:
            claim_key = ClaimKey.decode(key)
            obj = json.loads(value)
            return Claim(claim_key, str(obj["owner"]),
                         tuple(Handover.from_json(h) for h in obj.get("history", ())))
        except (ValueError, TypeError, KeyError) as exc:
            raise OwnershipStoreError(
                f"ownership record {key!r:.200} does not decode ({exc}): it was not written "
                "by blockagg; delete it with a tombstone or point job.owners_topic at a "
                "topic of blockagg's own") from None


@dataclass(frozen=True)
class Decision:
    """What a start does with one key: ``owner`` (nothing to write), ``claim`` or
    ``take_over`` (write ``record``, replacing ``current``)."""

    kind: Literal["owner", "claim", "take_over"]
    key: ClaimKey
    current: Claim | None
    record: Claim | None
    from_group: str = ""


def _shown_offsets(offsets: Mapping[int, int]) -> str:
    if not offsets:
        return "no committed offset"
    return "committed resume offsets " + ", ".join(
        f"[{p}]={o}" for p, o in sorted(offsets.items()))


def owned_message(key: ClaimKey, owner: str, since_ms: int, group: str,
                  delivered: Mapping[int, int], take_over_from: str) -> str:
    """The refusal of a start by ``group`` of a key ``owner`` holds (one line)."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since_ms / 1000))
    wrong = (f" (job.take_over_from names {take_over_from!r}, not the owner)"
             if take_over_from else "")
    return (
        f"topic {key.topic} is delivered into shard {key.shard} by group {owner!r} "
        f"(since {since}; {owner}'s {_shown_offsets(delivered)}), not by group "
        f"{group!r}{wrong}: a second group would store its messages again. Restart with "
        f"--group {owner} (job.metadata_group_id), or take over deliberately from where "
        f"{owner} stopped with --take-over {owner} (job.take_over_from) once its job is "
        f"stopped; a start after what is stored needs --take-over {owner} too")


def decide(key: ClaimKey, current: Claim | None, group: str, take_over_from: str,
           now_ms: int, run: str = "",
           owner_offsets: Mapping[int, int] | None = None) -> Decision:
    """The decision of a start of ``group`` for ``key`` (pure).

    ``take_over_from`` (``job.take_over_from``, "" when unset) is honoured only when
    it names the current owner, or when the key has no record (the group that
    delivered before ownership was recorded); it is ignored once ``group`` owns the
    key, so a configuration that keeps it restarts as the owner. ``owner_offsets``
    are the from-group's committed resume offsets, recorded in a take-over."""
    offsets = tuple(sorted((owner_offsets or {}).items()))
    if current is not None and current.owner == group:
        return Decision("owner", key, current, None)
    if current is None and not take_over_from:
        return Decision("claim", key, None,
                        Claim(key, group, (Handover(group, "", now_ms, (), run),)))
    if current is None or take_over_from == current.owner:
        history = (current.history if current is not None else ())
        entry = Handover(group, take_over_from, now_ms, offsets, run)
        return Decision("take_over", key, current,
                        Claim(key, group, (*history, entry)[-HISTORY_KEPT:]), take_over_from)
    raise TopicOwned(owned_message(key, current.owner, current.since_ms, group,
                                   owner_offsets or {}, take_over_from))


def owners_transactional_id(topic: str) -> str:
    """The one transactional id of every write to ownership topic ``topic``."""
    return f"blockagg.owners.{topic}"


class OwnersStore:
    """The ownership topic over confluent-kafka (``config``: librdkafka settings)."""

    def __init__(self, config: Mapping[str, Any], topic: str = DEFAULT_TOPIC,
                 timeout_s: float = 15.0) -> None:
        from blockagg.aggregator.kafka.log_store import KafkaStore

        self.config = {k: v for k, v in config.items()}
        self.topic = topic
        self.timeout_s = timeout_s
        self._log = KafkaStore(self.config, topic, timeout_s)

    def cluster_id(self) -> str:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(logs.kafka_client_config(self.config))
        try:
            cluster = admin.list_topics(timeout=self.timeout_s).cluster_id
        except Exception as exc:
            raise OwnershipStoreError(f"can't read the Kafka cluster id: {exc}") from exc
        return str(cluster or "")

    def read(self) -> dict[ClaimKey, Claim]:
        """Every key's last record (a tombstone removes the key)."""
        from blockagg.proto.exceptions import RegistryError

        try:
            entries, _end = self._log.scan()
        except RegistryError as exc:
            raise OwnershipStoreError(f"ownership topic {self.topic}: {exc}") from None
        claims: dict[ClaimKey, Claim] = {}
        for _offset, key, value in entries:
            if key is None:
                continue
            if value is None:
                claims.pop(ClaimKey.decode(key), None)
                continue
            claim = Claim.decode(key, value)
            claims[claim.key] = claim
        return claims

    def write(self, decisions: Sequence[Decision],
              copies: Mapping[str, Sequence[tuple[str, int, int, str]]] | None = None,
              sleep: Callable[[float], None] = time.sleep) -> None:
        """Write the records of ``decisions`` (and copy ``copies``: group ->
        (topic, partition, offset, metadata) commits) in one transaction, provided no
        key changed since it was decided on (:class:`ClaimRaced` otherwise). A fenced
        attempt (another writer initialised the id) is retried from the fenced read."""
        from confluent_kafka import KafkaException

        self._log.ensure_topic()
        for attempt in range(CLAIM_ATTEMPTS):
            try:
                self._write_once(decisions, copies or {})
                return
            except KafkaException as exc:
                if attempt + 1 == CLAIM_ATTEMPTS:
                    raise OwnershipStoreError(
                        f"could not write the ownership record to {self.topic} after "
                        f"{CLAIM_ATTEMPTS} attempts ({exc}): another job claims at the same "
                        "time, or the brokers refuse transactions; start again") from None
                log.info("ownership write attempt %d failed (%s); again", attempt + 1, exc)
                sleep(random.uniform(0.2, 1.5))

    def _write_once(self, decisions: Sequence[Decision],
                    copies: Mapping[str, Sequence[tuple[str, int, int, str]]]) -> None:
        from confluent_kafka import Consumer, Producer, TopicPartition

        from blockagg.aggregator.kafka.fencing import CONSUMER_ONLY, TRANSACTION_TIMEOUT_MS

        settings = {k: v for k, v in self.config.items() if k not in CONSUMER_ONLY}
        settings.update({"transactional.id": owners_transactional_id(self.topic),
                         "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS})
        producer = Producer(logs.kafka_client_config(settings))
        try:
            producer.init_transactions(self.timeout_s)  # fences every earlier writer
            now = self.read()  # after the fence: every committed claim is visible
            for d in decisions:
                if now.get(d.key) != d.current:
                    shown = now[d.key].owner if d.key in now else "nobody"
                    raise ClaimRaced(
                        f"topic {d.key.topic} into shard {d.key.shard} was claimed by "
                        f"{shown!r} while this job started; start again (it will be refused "
                        "or go on as that record says)")
            producer.begin_transaction()
            for d in decisions:
                assert d.record is not None
                producer.produce(self.topic, key=d.key.encode(), value=d.record.encode())
            for group, commits in copies.items():
                if not commits:
                    continue
                consumer = Consumer(logs.kafka_client_config(
                    {**self.config, "group.id": group, "enable.auto.commit": False}))
                try:
                    producer.send_offsets_to_transaction(
                        [TopicPartition(t, p, o, metadata=m) for t, p, o, m in commits],
                        consumer.consumer_group_metadata(), self.timeout_s)
                finally:
                    consumer.close()
            producer.commit_transaction(self.timeout_s)
        finally:
            producer.flush(1)

