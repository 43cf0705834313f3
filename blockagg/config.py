"""The job's configuration: one TOML file validated into frozen, typed dataclasses.

Every key is documented in ``docs/configuration.md``. The rules:

* Unknown keys are refused, with the key's full path and the closest known key.
* Contradictory settings are refused with both keys named (``insert_quorum`` above a
  shard's replica count, ``minPartitions`` in the source options, two topics entries
  for one topic, ...).
* Pass-through sections (``[kafka]``, ``[kafka.spark]``, ``[kafka.librdkafka]``,
  ``[source]``, ``[clickhouse.settings]``) are handed to the clients as they are, apart
  from the few keys the job owns (it refuses those, saying why).
* Secrets never appear in ``repr``, ``str`` or logs: they are :class:`Secret` values.
  Any string value may be ``"${env:NAME}"`` (read from the environment at load), and
  ``[clickhouse] password_env = "NAME"`` is the short form for the password.
* Flags override the file through :func:`load` ``overrides``: a mapping of dotted
  paths (``"job.trigger_interval"``) to values, applied before validation, so a flag
  is checked exactly like the key it overrides.

Above 500 lines because it is the one typed configuration: every section, default, check and
message, found by searching one file (``docs/architecture.md``, *Why the config is hand-
written*).
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from blockagg.exceptions import ConfigError

__all__ = [
    "BlocksConfig",
    "ClickHouseConfig",
    "Config",
    "DeadLettersConfig",
    "JobConfig",
    "KafkaConfig",
    "MetricsConfig",
    "MissingBlock",
    "Replica",
    "SchemasConfig",
    "Secret",
    "TopicConfig",
    "load",
    "loads",
    "parse_duration",
    "parse_size",
]

T = TypeVar("T")

_ENV_REF: Final = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")

SECRET_KEY_PARTS: Final = ("password", "secret", "jaas", "token", "key.pem", "credentials")
"""A pass-through key holding one of these substrings is treated as a secret."""

# Keys of the Spark Kafka source the job sets itself; [source] may not set them.
_SOURCE_OWNED: Final[Mapping[str, str]] = {
    "subscribe": "set from [[topics]] name",
    "subscribepattern": "set from [[topics]] pattern",
    "assign": "the job subscribes to the [[topics]] entries",
    "startingoffsets": "computed from the committed metadata; set [job] starting_offsets "
    "for partitions without a commit",
    "startingtimestamp": "the start is the committed metadata; use [job] starting_offsets",
    "startingoffsetsbytimestamp": "the start is the committed metadata",
    "startingoffsetsbytimestampstrategy": "the start is the committed metadata",
    "endingoffsets": "a stream has no end",
    "failondataloss": "always true: a lost offset range must stop the job, not be skipped",
    "maxoffsetspertrigger": "use [job] max_offsets_per_trigger",
    "minpartitions": "a Kafka partition must never be split across Spark partitions "
    "(one aggregator per partition); remove it",
    "maxrecordsperpartition": "a Kafka partition must never be split across Spark "
    "partitions (one aggregator per partition); remove it",
}

# Kafka client keys the job owns; [kafka] may not set them.
_KAFKA_OWNED: Final[Mapping[str, str]] = {
    "group.id": "the metadata group is [job] metadata_group_id; Spark's source uses its own "
    "group",
    "isolation.level": "always read_committed: aborted transactions must never reach "
    "ClickHouse",
    "enable.auto.commit": "offsets are committed by the aggregator with its metadata only",
    "auto.offset.reset": "use [job] starting_offsets",
    "key.deserializer": "the source reads raw bytes",
    "value.deserializer": "the source reads raw bytes",
    "enable.partition.eof": "managed by the job",
}


class Secret:
    """A string that never shows itself in ``repr``/``str``/f-strings."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret's value; pass it to a client, never to a log."""
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret('***')" if self._value else "Secret('')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __reduce__(self) -> tuple[type[Secret], tuple[str]]:
        return (Secret, (self._value,))


def is_secret_key(key: str) -> bool:
    """True when a pass-through key names a secret (masked everywhere)."""
    low = key.lower()
    return any(part in low for part in SECRET_KEY_PARTS)


PassValue = str | Secret


def _reveal(value: PassValue) -> str:
    return value.reveal() if isinstance(value, Secret) else value


def _masked(options: Mapping[str, PassValue]) -> dict[str, str]:
    return {k: repr(v) if isinstance(v, Secret) else v for k, v in options.items()}


# --------------------------------------------------------------------------- values

_DURATION_UNITS: Final[Mapping[str, float]] = {
    "ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001,
    "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hour": 3600.0, "hours": 3600.0,
}
_SIZE_UNITS: Final[Mapping[str, int]] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
    "k": 1024, "m": 1024**2, "g": 1024**3,
}
_QUANTITY: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_duration(value: object, path: str = "duration", zero: bool = False) -> float:
    """Seconds from ``1.5``, ``"500ms"``, ``"1s"``, ``"2 minutes"``; must be > 0 (or
    ``>= 0`` with ``zero``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a duration like \"1s\" or \"500ms\", got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        unit = match.group(2).lower() if match else ""
        if not match or (unit and unit not in _DURATION_UNITS):
            raise ConfigError(
                f"{path}: expected a duration like \"1s\", \"500ms\", \"2min\" or a number of "
                f"seconds, got {value!r}"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS.get(unit, 1.0)
    else:
        raise ConfigError(f"{path}: expected a duration like \"1s\", got {value!r}")
    if not (seconds >= 0 if zero else seconds > 0):
        raise ConfigError(f"{path}: must be {'0 or more' if zero else 'greater than 0'}, "
                          f"got {value!r}")
    return seconds


def parse_size(value: object, path: str = "size") -> int:
    """Bytes from ``1048576``, ``"10MiB"``, ``"64 MB"``; must be > 0."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a size like \"10MiB\" or bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{path}: expected a size like \"10MiB\", \"64MB\" or a number of bytes, "
                f"got {value!r}"
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{path}: expected a size like \"10MiB\", got {value!r}")
    if size <= 0:
        raise ConfigError(f"{path}: must be greater than 0, got {value!r}")
    return size


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True)
class Replica:
    """One ClickHouse replica of a shard: host and native-protocol port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """A topic (or a topic pattern) and the ClickHouse shard its tables go to."""

    name: str | None
    pattern: str | None
    replicas: tuple[Replica, ...]
    insert_quorum: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.name is not None else f"pattern {self.pattern!r}"

    def matches(self, topic: str) -> bool:
        if self.name is not None:
            return topic == self.name
        assert self.pattern is not None
        return re.fullmatch(self.pattern, topic) is not None


@dataclass(frozen=True, slots=True)
class MissingBlock:
    """A replay block the operator gives up rebuilding (``ReplayBlockMissing``): the
    block of ``table_id`` in ``[first, last]`` of ``topic[partition]``. Its messages
    that still exist go to the dead-letter table; everything else resumes as usual."""

    topic: str
    partition: int
    table_id: int
    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.topic}:{self.partition}:{self.table_id}:{self.first}-{self.last}"


@dataclass(frozen=True, slots=True)
class JobConfig:
    name: str = "blockagg"
    metadata_group_id: str = "blockagg"
    checkpoint_location: str = ""
    trigger_interval: float = 1.0
    max_offsets_per_trigger: int | None = None
    starting_offsets: Literal["earliest", "latest"] = "earliest"
    run_id: int | None = None
    offset_metadata_max_bytes: int = 4096
    lock_timeout: float = 60.0
    lock_session_timeout: float = 10.0
    stop_timeout: float = 300.0
    batch_timeout: float = 1800.0
    handover: Literal["arrow", "rows"] = "arrow"
    dead_letter_missing_blocks: tuple[MissingBlock, ...] = ()
    idle_commit_interval: float = 3600.0
    take_over_from: str = ""
    """The group whose delivery of the job's topics this group takes over, once
    (``--take-over``; ``aggregator.kafka.ownership``); "" for none."""
    owners_topic: str = "_blockagg_owners"
    """The compacted topic of the ownership records."""


@dataclass(frozen=True, slots=True)
class BlocksConfig:
    max_rows: int = 1_000_000
    max_bytes: int = 64 * 1024 * 1024
    min_rows: int = 0
    """The rows the ``min_rows_percentile`` block of a batch should reach; the driver
    sizes micro-batches for it (``spark.sizing``). 0: batches are not held."""
    min_rows_percentile: float = 0.5
    max_latency: float = 60.0
    """The user's bound on how long a message waits for its block while batches are
    held for ``min_rows``."""


@dataclass(frozen=True, slots=True, repr=False)
class ClickHouseConfig:
    database: str = "default"
    user: str = "default"
    password: Secret = field(default_factory=lambda: Secret(""))
    insert_quorum: int | None = None
    insert_quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    send_receive_timeout: float = 300.0
    retries: int = 5
    retry_backoff: float = 1.0
    insert_concurrency: int = 4
    executor_insert_concurrency: int = 0
    """Inserts in flight at once across all the tasks of one executor (0: no shared
    bound; each task runs up to ``insert_concurrency``). With it, a task's lanes take
    one of this many executor-wide permits for each insert
    (``aggregator.lanes.SharedPermits``)."""
    ping_after_idle: float = 5.0
    secure: bool = False
    verify: bool = True
    ca_certs: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    allow_small_dedup_window: bool = False
    allow_tables_without_coordinates: tuple[str, ...] = ()
    """Tables (``database.table``) the job may write on a server that deduplicates by
    content hash (no ``insert_deduplication_token``) although they lack the columns
    ``_topic``, ``_partition``, ``_offset``: there two different blocks with the same
    rows are one block, and the second is lost. Refused by default
    (``writer.check_tables``); listing a table accepts that loss."""
    replay_across_alter: str = "refuse"
    """What to do with a block that must be sent again after its table's columns
    changed, on a server that deduplicates by content hash, when the table has no
    Kafka coordinate columns to tell whether it landed: ``refuse`` (stop, nothing
    sent), ``insert`` (risk a duplicate) or ``skip`` (risk a loss). For one restart,
    after checking the table by hand (docs/schemas.md)."""
    expired_replay: str = "refuse"
    """What to do with a replay block whose first attempt may be older than its table's
    ``replicated_deduplication_window_seconds``, when the table has no Kafka
    coordinate columns to tell whether it landed: ``refuse``, ``insert`` or ``skip``,
    as ``replay_across_alter`` (docs/running.md)."""
    allow_stored_coordinates: bool = False
    """Deliver a partition that starts without a blockagg commit into tables that
    already hold rows at its coordinates and have no ``_incarnation`` column to tell
    them apart (``aggregator.clickhouse.stored``): refused by default, since on a
    server without tokens a new block equal to a stored one would be dropped."""
    shared_with_other_kafka_clusters: bool = False
    """Other Kafka clusters (another data centre's, with the same topic names) feed the
    same tables through their own jobs. On a server that deduplicates by content hash
    only a column in the block can keep two clusters' equal blocks apart, so the start
    refuses every table without ``_incarnation UInt64`` (``incarnation`` in the
    dead-letter table), and the ownership check counts only this cluster's rows
    (docs/running.md, *Two data centres into one shard*)."""

    def __repr__(self) -> str:
        return (
            f"ClickHouseConfig(database={self.database!r}, user={self.user!r}, "
            f"password={self.password!r}, insert_quorum={self.insert_quorum}, "
            f"insert_quorum_timeout={self.insert_quorum_timeout}, "
            f"connect_timeout={self.connect_timeout}, "
            f"send_receive_timeout={self.send_receive_timeout}, retries={self.retries}, "
            f"retry_backoff={self.retry_backoff}, "
            f"insert_concurrency={self.insert_concurrency}, "
            f"executor_insert_concurrency={self.executor_insert_concurrency}, "
            f"ping_after_idle={self.ping_after_idle}, secure={self.secure}, verify={self.verify}, "
            f"ca_certs={self.ca_certs!r}, settings={_masked(self.settings)!r}, "
            f"allow_small_dedup_window={self.allow_small_dedup_window}, "
            f"allow_tables_without_coordinates={self.allow_tables_without_coordinates!r}, "
            f"replay_across_alter={self.replay_across_alter!r}, "
            f"expired_replay={self.expired_replay!r}, "
            f"allow_stored_coordinates={self.allow_stored_coordinates}, "
            f"shared_with_other_kafka_clusters={self.shared_with_other_kafka_clusters})"
        )


@dataclass(frozen=True, slots=True, repr=False)
class KafkaConfig:
    """Kafka client settings: ``common`` go to every client, ``spark`` only to Spark's
    (Java) source, ``librdkafka`` only to the confluent-kafka clients (metadata store,
    schema registry, lock, lag)."""

    common: Mapping[str, PassValue] = field(default_factory=dict)
    spark: Mapping[str, PassValue] = field(default_factory=dict)
    librdkafka: Mapping[str, PassValue] = field(default_factory=dict)
    allow_unsafe_durability: bool = False
    """Start although a topic the job depends on could lose acknowledged records
    (replication factor 1, ``min.insync.replicas`` below 2 or unclean leader election,
    on a cluster of several brokers; ``kafka.durability``): each finding is a WARNING
    line instead of a refusal."""
    heal_hanging_transactions: bool = True
    """At start, end a hanging transaction on the metadata group's ``__consumer_offsets``
    partition by rolling its offset commit forward (``kafka.hanging``) instead of
    refusing to start until an operator aborts it."""

    @property
    def bootstrap_servers(self) -> str:
        return _reveal(self.common.get("bootstrap.servers", ""))

    def librdkafka_config(self) -> dict[str, str]:
        """The confluent-kafka client config (secrets revealed: hand to the client only)."""
        out = {k: _reveal(v) for k, v in self.common.items()}
        out.update({k: _reveal(v) for k, v in self.librdkafka.items()})
        return out

    def spark_source_options(self) -> dict[str, str]:
        """``kafka.``-prefixed options for Spark's source (secrets revealed).

        librdkafka's ``sasl.username``/``sasl.password`` become a Java
        ``sasl.jaas.config`` for the PLAIN and SCRAM mechanisms unless ``[kafka.spark]``
        sets one; ``sasl.mechanisms`` (librdkafka's spelling) becomes ``sasl.mechanism``.
        """
        java: dict[str, str] = {}
        username = self.common.get("sasl.username")
        password = self.common.get("sasl.password")
        for key, value in self.common.items():
            if key in ("sasl.username", "sasl.password"):
                continue
            java["sasl.mechanism" if key == "sasl.mechanisms" else key] = _reveal(value)
        java.update({k: _reveal(v) for k, v in self.spark.items()})
        if username is not None and "sasl.jaas.config" not in java:
            mechanism = java.get("sasl.mechanism", "PLAIN").upper()
            module = (
                "org.apache.kafka.common.security.plain.PlainLoginModule"
                if mechanism == "PLAIN"
                else "org.apache.kafka.common.security.scram.ScramLoginModule"
            )
            user = _reveal(username).replace("\\", "\\\\").replace('"', '\\"')
            secret = _reveal(password or "").replace("\\", "\\\\").replace('"', '\\"')
            java["sasl.jaas.config"] = (
                f'{module} required username="{user}" password="{secret}";'
            )
        return {f"kafka.{k}": v for k, v in java.items()}

    def __repr__(self) -> str:
        return (
            f"KafkaConfig(common={_masked(self.common)!r}, spark={_masked(self.spark)!r}, "
            f"librdkafka={_masked(self.librdkafka)!r}, "
            f"allow_unsafe_durability={self.allow_unsafe_durability}, "
            f"heal_hanging_transactions={self.heal_hanging_transactions})"
        )


@dataclass(frozen=True, slots=True)
class SchemasConfig:
    topic: str = "_blockagg_schemas"
    refresh_interval: float = 10.0


@dataclass(frozen=True, slots=True)
class DeadLettersConfig:
    table: str = "blockagg.dead_letters"
    topic: str | None = None
    max_rate: float = 1.0
    min_messages: int = 100
    window: int = 1


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    port: int = 9464
    host: str = "0.0.0.0"


@dataclass(frozen=True, slots=True, repr=False)
class Config:
    job: JobConfig
    topics: tuple[TopicConfig, ...]
    blocks: BlocksConfig
    clickhouse: ClickHouseConfig
    kafka: KafkaConfig
    source: Mapping[str, PassValue]
    schemas: SchemasConfig
    dead_letters: DeadLettersConfig
    metrics: MetricsConfig
    path: str | None = None

    def insert_quorum_for(self, topic: TopicConfig) -> int:
        """The ``insert_quorum`` of ``topic``'s inserts: its own, else
        ``clickhouse.insert_quorum``, else every replica of its shard (0, no quorum,
        for a shard of one replica). The safe default: a block is acknowledged only
        once every replica has it, so losing one replica right after the final commit
        loses nothing."""
        if topic.insert_quorum is not None:
            return topic.insert_quorum
        if self.clickhouse.insert_quorum is not None:
            return self.clickhouse.insert_quorum
        return len(topic.replicas) if len(topic.replicas) > 1 else 0

    def topic_for(self, topic: str) -> TopicConfig:
        """The [[topics]] entry serving ``topic``; exact names win over patterns."""
        for entry in self.topics:
            if entry.name == topic:
                return entry
        matches = [entry for entry in self.topics if entry.pattern and entry.matches(topic)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ConfigError(f"topic {topic!r} matches no [[topics]] entry")
        raise ConfigError(
            f"topic {topic!r} matches several [[topics]] patterns "
            f"({', '.join(repr(m.pattern) for m in matches)}): make them disjoint or add an "
            "entry with name = " + repr(topic)
        )

    @property
    def subscription(self) -> tuple[str, str]:
        """The Spark source's subscription: ``("subscribe", "a,b")`` or
        ``("subscribePattern", regex)`` when any entry is a pattern."""
        if all(t.name is not None for t in self.topics):
            return "subscribe", ",".join(t.name for t in self.topics if t.name)
        parts = [
            t.pattern if t.pattern is not None else re.escape(t.name or "") for t in self.topics
        ]
        return "subscribePattern", "|".join(f"(?:{p})" for p in parts)

    def summary(self) -> dict[str, object]:
        """A loggable view of the configuration (secrets masked)."""
        return {
            "path": self.path,
            "job": self.job,
            "topics": [
                {"topic": t.label, "replicas": [str(r) for r in t.replicas]} for t in self.topics
            ],
            "blocks": self.blocks,
            "clickhouse": self.clickhouse,
            "kafka": self.kafka,
            "source": _masked(self.source),
            "schemas": self.schemas,
            "dead_letters": self.dead_letters,
            "metrics": self.metrics,
        }

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.summary().items()) + ")"


# --------------------------------------------------------------------------- reading


class _Table:
    """A TOML table being read: typed ``take`` per key, then ``done`` refuses the rest."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table, got {type(data).__name__} {data!r}")
        self.data: dict[str, Any] = dict(data)
        self.path = path
        self.known: list[str] = []

    def key_path(self, key: str) -> str:
        shown = key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f'"{key}"'
        return f"{self.path}.{shown}" if self.path else shown

    def has(self, key: str) -> bool:
        return key in self.data

    def take(self, key: str, kind: Callable[[object, str], T], default: T) -> T:
        self.known.append(key)
        if key not in self.data:
            return default
        return kind(self.data.pop(key), self.key_path(key))

    def take_raw(self, key: str) -> object:
        self.known.append(key)
        return self.data.pop(key, None)

    def done(self) -> None:
        for key in self.data:
            hint = difflib.get_close_matches(key, self.known, n=1)
            also = f"; did you mean {hint[0]!r}?" if hint else ""
            known = ", ".join(sorted(self.known))
            raise ConfigError(
                f"{self.key_path(key)}: unknown key{also} (known keys here: {known})"
            )


def _str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def _nonempty(value: object, path: str) -> str:
    text = _str(value, path)
    if not text.strip():
        raise ConfigError(f"{path}: must not be empty")
    return text


def _int(minimum: int, maximum: int | None = None) -> Callable[[object, str], int]:
    def check(value: object, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise ConfigError(f"{path}: must be >= {minimum}{upper}, got {value}")
        return value

    return check


def _one_of(choices: Sequence[str]) -> Callable[[object, str], str]:
    def check(value: object, path: str) -> str:
        if value not in choices:
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, choices))}, "
                              f"got {value!r}")
        return str(value)

    return check


REPLAY_ACROSS_ALTER: Final = ("refuse", "insert", "skip")


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def _duration(value: object, path: str) -> float:
    return parse_duration(value, path)


def _duration_or_zero(value: object, path: str) -> float:
    return parse_duration(value, path, zero=True)


def _size(value: object, path: str) -> int:
    return parse_size(value, path)


def _rate(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: expected a fraction between 0 and 1, got {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{path}: must be between 0 and 1, got {value}")
    return float(value)


def _percentile(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: expected a fraction above 0 and at most 1 (0.5: the "
                          f"median block), got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ConfigError(f"{path}: must be above 0 and at most 1 (0.5: the median block), "
                          f"got {value}")
    return float(value)


def _check_min_rows(blocks: BlocksConfig, job: JobConfig) -> None:
    """``blocks.min_rows`` against the settings it works with: below ``max_rows``, and
    a latency bound that leaves at least one trigger interval to wait in."""
    if blocks.min_rows == 0:
        return
    if blocks.min_rows > blocks.max_rows:
        raise ConfigError(
            f"blocks.min_rows = {blocks.min_rows} is above blocks.max_rows = "
            f"{blocks.max_rows}: a block is sealed at max_rows, so lower min_rows or raise "
            "max_rows")
    if blocks.max_latency < 2 * job.trigger_interval:
        raise ConfigError(
            f"blocks.max_latency = {blocks.max_latency:g}s leaves no time to wait for rows "
            f"with job.trigger_interval = {job.trigger_interval:g}s: set it to at least "
            f"{2 * job.trigger_interval:g}s, or blocks.min_rows = 0")


def _table_name(value: object, path: str) -> str:
    text = _str(value, path)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*", text):
        raise ConfigError(f"{path}: expected \"database.table\", got {text!r}")
    return text


def _table_names(value: object, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of \"database.table\" strings, "
                          f"got {value!r}")
    return tuple(sorted({_table_name(item, f"{path}[{i}]") for i, item in enumerate(value)}))


def _group_id(value: object, path: str) -> str:
    text = _nonempty(value, path)
    if any(c.isspace() for c in text):
        raise ConfigError(f"{path}: must not contain whitespace, got {text!r}")
    return text


def _take_over(value: object, path: str) -> str:
    if value == "" or value is None:
        return ""
    return _group_id(value, path)


def _starting(value: object, path: str) -> Literal["earliest", "latest"]:
    if value == "earliest":
        return "earliest"
    if value == "latest":
        return "latest"
    raise ConfigError(
        f"{path}: expected \"earliest\" or \"latest\" (where partitions without committed "
        f"metadata start), got {value!r}"
    )


_MISSING_BLOCK: Final = re.compile(r"^([A-Za-z0-9._-]+):(\d+):(\d+):(\d+)-(\d+)$")


def _missing_blocks(value: object, path: str) -> tuple[MissingBlock, ...]:
    items = value if isinstance(value, list) else None
    if items is None or not all(isinstance(v, str) for v in items):
        raise ConfigError(
            f"{path}: expected a list of \"topic:partition:table_id:first-last\" strings "
            f"(as printed by ReplayBlockMissing), got {value!r}")
    out: list[MissingBlock] = []
    for item in items:
        match = _MISSING_BLOCK.match(item.strip())
        if match is None or int(match.group(4)) > int(match.group(5)):
            raise ConfigError(
                f"{path}: {item!r} is not \"topic:partition:table_id:first-last\" with "
                "first <= last (copy it from the ReplayBlockMissing message)")
        topic, partition, table_id, first, last = match.groups()
        out.append(MissingBlock(topic, int(partition), int(table_id), int(first), int(last)))
    return tuple(out)


def _handover(value: object, path: str) -> Literal["arrow", "rows"]:
    if value == "arrow":
        return "arrow"
    if value == "rows":
        return "rows"
    raise ConfigError(
        f"{path}: expected \"arrow\" (Arrow record batches, the default) or \"rows\" "
        f"(pickled Spark rows, the slower path kept as a baseline), got {value!r}"
    )


def _replica(value: object, path: str) -> Replica:
    text = _str(value, path)
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "9000"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{path}: expected \"host:port\" (native protocol), got {text!r}")
    return Replica(host, int(port))


def _scalar_str(value: object, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise ConfigError(f"{path}: expected a string, number or boolean, got {value!r}")


def _check_producer_durability(section: str, opts: Mapping[str, PassValue]) -> None:
    """Refuse producer settings that would let Kafka acknowledge a record it can lose:
    the job's producers are idempotent with ``acks=all`` (its transactional producers
    cannot be otherwise: librdkafka would refuse them at the first commit, in a task)."""
    acks = str(opts.get("acks", "all")).strip().lower()
    if acks not in ("all", "-1"):
        raise ConfigError(
            f'{section}."acks" = {acks!r}: a record acknowledged by fewer than every in-sync '
            "replica can be lost, and the job's transactional producers require acks=all: "
            "remove the key (the job uses all)")
    idempotence = str(opts.get("enable.idempotence", "true")).strip().lower()
    if idempotence != "true":
        raise ConfigError(
            f'{section}."enable.idempotence" = {idempotence!r}: a retried produce could write '
            "a record twice, and the job's transactional producers require idempotence: "
            "remove the key (the job enables it)")


def _passthrough(
    table: _Table, owned: Mapping[str, str], skip: tuple[str, ...] = (), lower: bool = False
) -> dict[str, PassValue]:
    out: dict[str, PassValue] = {}
    for key in list(table.data):
        if key in skip:
            continue
        value = table.data.pop(key)
        path = table.key_path(key)
        reason = owned.get(key.lower() if lower else key)
        if reason is not None:
            raise ConfigError(f"{path}: set by the job, not allowed here ({reason})")
        if isinstance(value, dict):
            raise ConfigError(
                f"{path}: expected a value, got a table; quote dotted keys, e.g. "
                f"\"{key}.x\" = ..."
            )
        text = _scalar_str(value, path)
        out[key] = Secret(text) if is_secret_key(key) else text
    return out


def _expand_env(value: object, path: str, env: Mapping[str, str]) -> object:
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{path}.{k}" if path else k, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{path}[{i}]", env) for i, v in enumerate(value)]
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                raise ConfigError(
                    f"{path}: environment variable {name} is not set (referenced as "
                    f"${{env:{name}}})"
                )
            return env[name]

        return _ENV_REF.sub(sub, value)
    return value


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, object]) -> None:
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: expected \"section.key\"")
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"override {dotted!r}: [{section}] is not a table")
        target[key] = value


def _parse_topics(raw: object) -> tuple[TopicConfig, ...]:
    entries: list[tuple[str, object]] = []
    if isinstance(raw, list):
        entries = [(f"topics[{i}]", item) for i, item in enumerate(raw)]
    elif isinstance(raw, dict):
        for name, item in raw.items():
            if isinstance(item, dict) and "name" not in item and "pattern" not in item:
                item = {"name": name, **item}
            entries.append((f"topics.{name}", item))
    elif raw is None:
        entries = []
    else:
        raise ConfigError(f"topics: expected [[topics]] entries, got {raw!r}")
    if not entries:
        raise ConfigError(
            "topics: at least one [[topics]] entry is required, e.g.\n"
            "  [[topics]]\n  name = \"events\"\n  replicas = [\"ch1:9000\", \"ch2:9000\"]"
        )
    topics: list[TopicConfig] = []
    seen: dict[str, str] = {}
    for path, item in entries:
        table = _Table(item, path)
        name = table.take("name", _nonempty, None)
        pattern = table.take("pattern", _nonempty, None)
        replicas_raw = table.take_raw("replicas")
        quorum = table.take("insert_quorum", _int(0), None)
        table.done()
        if (name is None) == (pattern is None):
            raise ConfigError(f"{path}: set exactly one of name or pattern")
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"{path}.pattern: not a valid regex: {exc}") from exc
        if not isinstance(replicas_raw, list) or not replicas_raw:
            raise ConfigError(
                f"{path}.replicas: expected a non-empty list of \"host:port\" ClickHouse "
                f"replicas of the topic's shard, got {replicas_raw!r}"
            )
        replicas = tuple(
            _replica(r, f"{path}.replicas[{i}]") for i, r in enumerate(replicas_raw)
        )
        if len(set(replicas)) != len(replicas):
            raise ConfigError(f"{path}.replicas: lists a replica twice: {replicas_raw!r}")
        ident = f"name:{name}" if name is not None else f"pattern:{pattern}"
        if ident in seen:
            raise ConfigError(
                f"{path}: duplicate topic {name or pattern!r}, already configured in "
                f"{seen[ident]}; one topic maps to exactly one shard"
            )
        seen[ident] = path
        topics.append(TopicConfig(name, pattern, replicas, quorum))
    return tuple(topics)


def loads(
    text: str,
    overrides: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    path: str | None = None,
) -> Config:
    """Validate a TOML document into a :class:`Config`; raises :class:`ConfigError`."""
    where = path or "<config>"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from exc
    return from_dict(data, overrides, env, path)


def load(
    path: str | os.PathLike[str],
    overrides: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Read and validate the TOML file at ``path``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {str(p)!r}: {exc}") from exc
    return loads(text, overrides, env, str(p))


def from_dict(
    data: Mapping[str, Any],
    overrides: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    path: str | None = None,
) -> Config:
    """Validate already-parsed TOML data (see :func:`loads`)."""
    environ = os.environ if env is None else env
    raw: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    _apply_overrides(raw, overrides or {})
    expanded = _expand_env(raw, "", environ)
    assert isinstance(expanded, dict)
    root = _Table(expanded, "")

    job_t = _Table(root.take_raw("job") or {}, "job")
    checkpoint = job_t.take("checkpoint_location", _nonempty, "")
    job = JobConfig(
        name=job_t.take("name", _nonempty, "blockagg"),
        metadata_group_id=job_t.take("metadata_group_id", _group_id, "blockagg"),
        checkpoint_location=checkpoint,
        trigger_interval=job_t.take("trigger_interval", _duration, 1.0),
        max_offsets_per_trigger=job_t.take("max_offsets_per_trigger", _int(1), None),
        starting_offsets=job_t.take("starting_offsets", _starting, "earliest"),
        run_id=job_t.take("run_id", _int(0, 2**64 - 1), None),
        offset_metadata_max_bytes=job_t.take("offset_metadata_max_bytes", _int(64), 4096),
        lock_timeout=job_t.take("lock_timeout", _duration, 60.0),
        lock_session_timeout=job_t.take("lock_session_timeout", _duration, 10.0),
        stop_timeout=job_t.take("stop_timeout", _duration, 300.0),
        batch_timeout=job_t.take("batch_timeout", _duration, 1800.0),
        handover=job_t.take("handover", _handover, "arrow"),
        dead_letter_missing_blocks=job_t.take("dead_letter_missing_blocks", _missing_blocks,
                                              ()),
        idle_commit_interval=job_t.take("idle_commit_interval", _duration, 3600.0),
        take_over_from=job_t.take("take_over_from", _take_over, ""),
        owners_topic=job_t.take("owners_topic", _nonempty, "_blockagg_owners"),
    )
    job_t.done()
    if job.lock_session_timeout >= job.lock_timeout:
        raise ConfigError(
            f"job.lock_session_timeout ({job.lock_session_timeout:g}s) must be below "
            f"job.lock_timeout ({job.lock_timeout:g}s): after a kill -9 the previous run's "
            "membership only expires after the session timeout, so a restart would always "
            "refuse to start"
        )
    if job.lock_session_timeout < 1.0:
        raise ConfigError(
            f"job.lock_session_timeout: must be at least 1s (and at least the brokers' "
            f"group.min.session.timeout.ms, 6s by default), got {job.lock_session_timeout:g}s"
        )
    if not job.checkpoint_location:
        raise ConfigError(
            "job.checkpoint_location: required (Spark's checkpoint directory, e.g. "
            "\"hdfs:///blockagg/checkpoints/events\" or a local path; losing it is safe, the "
            "job restarts from the committed metadata)"
        )

    topics = _parse_topics(root.take_raw("topics"))

    blocks_t = _Table(root.take_raw("blocks") or {}, "blocks")
    blocks = BlocksConfig(
        max_rows=blocks_t.take("max_rows", _int(1), 1_000_000),
        max_bytes=blocks_t.take("max_bytes", _size, 64 * 1024 * 1024),
        min_rows=blocks_t.take("min_rows", _int(0), 0),
        min_rows_percentile=blocks_t.take("min_rows_percentile", _percentile, 0.5),
        max_latency=blocks_t.take("max_latency", _duration, 60.0),
    )
    blocks_t.done()
    _check_min_rows(blocks, job)

    ch_t = _Table(root.take_raw("clickhouse") or {}, "clickhouse")
    password_env = ch_t.take("password_env", _nonempty, None)
    if password_env is not None and ch_t.has("password"):
        raise ConfigError(
            "clickhouse.password and clickhouse.password_env are both set: keep one"
        )
    password = ch_t.take("password", _str, "")
    if password_env is not None:
        if password_env not in environ:
            raise ConfigError(
                f"clickhouse.password_env: environment variable {password_env} is not set"
            )
        password = environ[password_env]
    settings_raw = ch_t.take_raw("settings") or {}
    settings_t = _Table(settings_raw, "clickhouse.settings")
    settings: dict[str, Any] = {}
    for key in list(settings_t.data):
        value = settings_t.data.pop(key)
        if key in ("insert_quorum", "insert_quorum_timeout", "insert_deduplicate",
                   "insert_deduplication_token"):
            raise ConfigError(
                f"{settings_t.key_path(key)}: set by the job (use clickhouse.insert_quorum / "
                "clickhouse.insert_quorum_timeout; deduplication is always on)"
            )
        if isinstance(value, dict | list):
            raise ConfigError(f"{settings_t.key_path(key)}: expected a scalar, got {value!r}")
        settings[key] = value
    clickhouse = ClickHouseConfig(
        database=ch_t.take("database", _nonempty, "default"),
        user=ch_t.take("user", _nonempty, "default"),
        password=Secret(password),
        insert_quorum=ch_t.take("insert_quorum", _int(0), None),
        insert_quorum_timeout=ch_t.take("insert_quorum_timeout", _duration, 60.0),
        connect_timeout=ch_t.take("connect_timeout", _duration, 10.0),
        send_receive_timeout=ch_t.take("send_receive_timeout", _duration, 300.0),
        retries=ch_t.take("retries", _int(0), 5),
        retry_backoff=ch_t.take("retry_backoff", _duration, 1.0),
        insert_concurrency=ch_t.take("insert_concurrency", _int(1, 64), 4),
        executor_insert_concurrency=ch_t.take("executor_insert_concurrency", _int(0, 256), 0),
        ping_after_idle=ch_t.take("ping_after_idle", _duration_or_zero, 5.0),
        secure=ch_t.take("secure", _bool, False),
        verify=ch_t.take("verify", _bool, True),
        ca_certs=ch_t.take("ca_certs", _nonempty, None),
        settings=settings,
        allow_small_dedup_window=ch_t.take("allow_small_dedup_window", _bool, False),
        allow_tables_without_coordinates=ch_t.take("allow_tables_without_coordinates",
                                                    _table_names, ()),
        replay_across_alter=ch_t.take("replay_across_alter", _one_of(REPLAY_ACROSS_ALTER),
                                      "refuse"),
        expired_replay=ch_t.take("expired_replay", _one_of(REPLAY_ACROSS_ALTER), "refuse"),
        allow_stored_coordinates=ch_t.take("allow_stored_coordinates", _bool, False),
        shared_with_other_kafka_clusters=ch_t.take("shared_with_other_kafka_clusters", _bool,
                                                   False),
    )
    ch_t.done()
    for topic in topics:
        quorum = topic.insert_quorum if topic.insert_quorum is not None else (
            clickhouse.insert_quorum)
        if quorum is not None and quorum > len(topic.replicas):
            key = "insert_quorum of " + topic.label if topic.insert_quorum is not None else (
                "clickhouse.insert_quorum")
            raise ConfigError(
                f"{key} = {quorum} but the shard of {topic.label} lists only "
                f"{len(topic.replicas)} replica(s): lower the quorum or list every replica"
            )

    kafka_t = _Table(root.take_raw("kafka") or {}, "kafka")
    spark_raw = kafka_t.data.pop("spark", {}) if isinstance(kafka_t.data.get("spark"), dict) \
        else {}
    rdk_raw = kafka_t.data.pop("librdkafka", {}) \
        if isinstance(kafka_t.data.get("librdkafka"), dict) else {}
    allow_unsafe = kafka_t.take("allow_unsafe_durability", _bool, False)
    heal_hanging = kafka_t.take("heal_hanging_transactions", _bool, True)
    common = _passthrough(kafka_t, _KAFKA_OWNED)
    spark_opts = _passthrough(_Table(spark_raw, "kafka.spark"), _KAFKA_OWNED)
    rdk_opts = _passthrough(_Table(rdk_raw, "kafka.librdkafka"), _KAFKA_OWNED)
    for key in [*spark_opts, *rdk_opts]:
        if key.startswith("kafka."):
            raise ConfigError(
                f"kafka: key {key!r} must be given without the \"kafka.\" prefix (the job adds "
                "it for Spark's source)"
            )
    for key in common:
        if key.startswith("kafka."):
            raise ConfigError(
                f"kafka.\"{key}\": give Kafka client keys without the \"kafka.\" prefix, "
                f"e.g. \"{key[6:]}\""
            )
    for section, opts in (("kafka", common), ("kafka.librdkafka", rdk_opts)):
        _check_producer_durability(section, opts)
    kafka = KafkaConfig(common, spark_opts, rdk_opts, allow_unsafe, heal_hanging)
    if not kafka.bootstrap_servers:
        raise ConfigError(
            "kafka.\"bootstrap.servers\": required, e.g. \"bootstrap.servers\" = "
            "\"broker1:9092,broker2:9092\" under [kafka] (or --bootstrap-servers)"
        )

    source_t = _Table(root.take_raw("source") or {}, "source")
    for key in source_t.data:
        if key.startswith("kafka."):
            raise ConfigError(
                f"{source_t.key_path(key)}: Kafka client keys go under [kafka] without the "
                "\"kafka.\" prefix"
            )
    source = _passthrough(source_t, _SOURCE_OWNED, lower=True)
    held = sorted(k for k in source if k.lower() in ("minoffsetspertrigger", "maxtriggerdelay"))
    if blocks.min_rows and held:
        raise ConfigError(
            f"source.{held[0]}: set by the job when blocks.min_rows = {blocks.min_rows} "
            "(it sizes micro-batches from the blocks they form); remove it, or set "
            "blocks.min_rows = 0 to size batches by hand")

    schemas_t = _Table(root.take_raw("schemas") or {}, "schemas")
    schemas = SchemasConfig(
        topic=schemas_t.take("topic", _nonempty, "_blockagg_schemas"),
        refresh_interval=schemas_t.take("refresh_interval", _duration, 10.0),
    )
    schemas_t.done()
    if any(t.matches(schemas.topic) for t in topics):
        raise ConfigError(
            f"schemas.topic = {schemas.topic!r} is also a data topic in [[topics]]: the "
            "registry topic must be separate"
        )
    if any(t.matches(job.owners_topic) for t in topics):
        raise ConfigError(
            f"job.owners_topic = {job.owners_topic!r} is also a data topic in [[topics]]: "
            "the ownership topic must be separate"
        )
    if job.take_over_from == job.metadata_group_id:
        raise ConfigError(
            f"job.take_over_from = {job.take_over_from!r} is the job's own "
            "metadata_group_id: name the group to take over from, or leave it unset"
        )

    dl_t = _Table(root.take_raw("dead_letters") or {}, "dead_letters")
    dead_letters = DeadLettersConfig(
        table=dl_t.take("table", _table_name, "blockagg.dead_letters"),
        topic=dl_t.take("topic", _nonempty, None),
        max_rate=dl_t.take("max_rate", _rate, 1.0),
        min_messages=dl_t.take("min_messages", _int(0), 100),
        window=dl_t.take("window", _int(1, 10_000), 1),
    )
    dl_t.done()
    if dead_letters.topic is not None and any(t.matches(dead_letters.topic) for t in topics):
        raise ConfigError(
            f"dead_letters.topic = {dead_letters.topic!r} is also a data topic in [[topics]]: "
            "dead letters would be read back as input"
        )

    metrics_t = _Table(root.take_raw("metrics") or {}, "metrics")
    metrics = MetricsConfig(
        port=metrics_t.take("port", _int(0, 65535), 9464),
        host=metrics_t.take("host", _nonempty, "0.0.0.0"),
    )
    metrics_t.done()

    root.done()
    return Config(
        job=job,
        topics=topics,
        blocks=blocks,
        clickhouse=clickhouse,
        kafka=kafka,
        source=source,
        schemas=schemas,
        dead_letters=dead_letters,
        metrics=metrics,
        path=path,
    )


def iter_keys() -> Iterator[str]:
    """Every fixed key path (for docs checks)."""
    for section, cls in (
        ("job", JobConfig), ("blocks", BlocksConfig), ("clickhouse", ClickHouseConfig),
        ("schemas", SchemasConfig), ("dead_letters", DeadLettersConfig),
        ("metrics", MetricsConfig),
    ):
        for name in cls.__dataclass_fields__:
            yield f"{section}.{name}"
    yield "clickhouse.password_env"
    yield "kafka.allow_unsafe_durability"
    yield "kafka.heal_hanging_transactions"
