"""The real readers of ``arv audit``: Kafka (confluent-kafka) and ClickHouse (native protocol).

Neither holds more than one fetched batch (Kafka) or one result block (ClickHouse) in
memory: messages are read with explicit assignment and reduced to their envelope's table
name and row count; row counts per offset are aggregated and sorted by the server and
streamed with ``execute_iter``. Nothing is committed, no group is joined.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Final

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from google.protobuf.message import DecodeError

from blockagg import logs
from blockagg.aggregator.kafka.errors import describe
from blockagg.proto.blockagg.v1.envelope_pb2 import Envelope
from blockagg.proto.envelope import is_table_name
from blockagg.rows.columns import COORDINATE_COLUMNS
from blockagg.verifier.audit import Committed, Message
from blockagg.verifier.exceptions import AuditError
from blockagg.verifier.history import RESERVED_SETTINGS

FETCH_MESSAGES: Final = 10_000

DEFAULT_SETTINGS: Final = {"queued.max.messages.kbytes": "16384"}
"""librdkafka's prefetch buffer (default 64 MiB) is most of arv's memory; ``-X`` may
change it."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return str(exc.args[0].str())
    return describe(exc)


_TABLE_NAMES: dict[str, bool] = {}


def classify(offset: int, value: bytes | None) -> Message:
    """The message's table and row count, or ``table=None`` for an envelope the job
    rejects; the same rules as :func:`proto.envelope.parse_envelope` (a test checks
    it), without copying the rows or matching a table name twice."""
    if value is None:
        return Message(offset, None, 0)
    try:
        envelope = Envelope.FromString(value)
    except (DecodeError, ValueError, TypeError):
        return Message(offset, None, 0)
    table = envelope.table
    valid = _TABLE_NAMES.get(table)
    if valid is None:
        valid = is_table_name(table)
        if len(_TABLE_NAMES) < 100_000:
            _TABLE_NAMES[table] = valid
    rows = len(envelope.rows)
    if not valid or not rows:
        return Message(offset, None, 0)
    return Message(offset, table, rows)


class KafkaAuditReader:
    """Reads the group's commits and the data partitions; commits nothing.

    Two clients: one with ``group.id`` = the audited group, used only to fetch its
    committed offsets (it never subscribes, so it never joins the group), and one with a
    throw-away group id that reads the data partitions by explicit assignment with
    ``isolation.level=read_committed`` (aborted records are never delivered, so they are
    never expected in ClickHouse).
    """

    def __init__(self, bootstrap_servers: str, group: str,
                 settings: Mapping[str, str] | None = None, timeout: float = 10.0) -> None:
        self.group = group
        self.timeout = timeout
        self.bootstrap_servers = bootstrap_servers
        base: dict[str, Any] = {**DEFAULT_SETTINGS, **(settings or {}), **RESERVED_SETTINGS,
                                "bootstrap.servers": bootstrap_servers}
        self._settings = dict(settings or {})
        try:
            self._data = Consumer(logs.kafka_client_config(
                {**base, "group.id": f"blockagg-arv-{uuid.uuid4().hex}"}))
            self._offsets = Consumer(logs.kafka_client_config({**base, "group.id": group}))
        except (KafkaException, ValueError) as exc:
            raise AuditError(f"cannot create the Kafka consumer: {_reason(exc)}") from exc

    def incarnation(self, topic: str) -> int | None:
        """The topic's current incarnation (``aggregator.kafka.incarnation``), or
        ``None`` when the cluster does not say: then every row at a coordinate counts."""
        from blockagg.aggregator.kafka.incarnation import IncarnationError, TopicIncarnations

        try:
            return TopicIncarnations({**self._settings,
                                      "bootstrap.servers": self.bootstrap_servers},
                                     self.timeout).of(topic)
        except IncarnationError:
            return None

    def _topic_metadata(self, topic: str | None) -> Any:
        try:
            return self._data.list_topics(topic, timeout=self.timeout)
        except KafkaException as exc:
            raise AuditError(
                f"cannot reach the Kafka cluster {self.bootstrap_servers!r}: {_reason(exc)}; "
                "check --bootstrap-servers "
                "and the security settings (-X security.protocol=...)") from exc

    def group_topics(self) -> list[str]:
        from confluent_kafka import ConsumerGroupTopicPartitions
        from confluent_kafka.admin import AdminClient

        self._topic_metadata(None)  # a clear error when the cluster is unreachable
        admin = AdminClient(logs.kafka_client_config(
            {**self._settings, "bootstrap.servers": self.bootstrap_servers}))
        futures = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(self.group)], request_timeout=self.timeout)
        try:
            result = futures[self.group].result(timeout=self.timeout + 5)
        except Exception as exc:
            raise AuditError(f"cannot list the committed offsets of group {self.group!r}: "
                             f"{_reason(exc)}") from exc
        return sorted({tp.topic for tp in result.topic_partitions or []
                       if tp.offset is not None and tp.offset >= 0})

    def partitions(self, topic: str) -> list[int]:
        meta = self._topic_metadata(topic).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            error = meta.error if meta is not None else "not in the metadata"
            raise AuditError(f"cannot read topic {topic!r}: {error}; check --topic")
        return sorted(meta.partitions)

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        try:
            low, high = self._data.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=self.timeout, cached=False)
        except KafkaException as exc:
            raise AuditError(
                f"cannot read the watermarks of {topic}[{partition}]: {_reason(exc)}") from exc
        return int(low), int(high)

    def committed(self, topic: str, partitions: list[int]) -> dict[int, Committed]:
        try:
            result = self._offsets.committed([TopicPartition(topic, p) for p in partitions],
                                             timeout=self.timeout)
        except KafkaException as exc:
            raise AuditError(f"cannot fetch the committed offsets of group {self.group!r} "
                             f"for {topic}: {_reason(exc)}") from exc
        committed: dict[int, Committed] = {}
        for tp in result:
            if tp.error is not None:
                raise AuditError(f"cannot fetch the committed offset of group {self.group!r} "
                                 f"for {topic}[{tp.partition}]: {tp.error}")
            if tp.offset >= 0:
                committed[tp.partition] = Committed(tp.offset, tp.metadata or "")
        return committed

    def messages(self, topic: str, partition: int, start: int, end: int) -> Iterator[Message]:
        if start >= end:
            return
        self._data.assign([TopicPartition(topic, partition, start)])
        try:
            idle_since = time.monotonic()
            while True:
                batch = self._data.consume(num_messages=FETCH_MESSAGES, timeout=0.5)
                if not batch:
                    if time.monotonic() - idle_since > self.timeout:
                        raise AuditError(f"reading {topic}[{partition}] stalled for "
                                         f"{self.timeout}s before offset {end}")
                    continue
                idle_since = time.monotonic()
                for msg in batch:
                    error = msg.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            return
                        if error.fatal() or not error.retriable():
                            raise AuditError(f"reading {topic}[{partition}] failed: {error}")
                        continue
                    offset = msg.offset()
                    if offset is None:
                        continue
                    if offset >= end:
                        return
                    yield classify(offset, msg.value())
        finally:
            self._data.unassign()

    def close(self) -> None:
        self._data.close()
        self._offsets.close()

    def __enter__(self) -> KafkaAuditReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quote(table: str) -> str:
    database, name = table.split(".", 1)
    return f"`{database}`.`{name}`"


class ClickHouseAuditReader:
    """Row counts per Kafka offset, aggregated and ordered by the server, streamed."""

    def __init__(self, host: str, port: int, user: str, password: str,
                 settings: Mapping[str, Any] | None = None, timeout: float = 10.0,
                 tls: Mapping[str, Any] | None = None) -> None:
        """``tls``: clickhouse-driver's TLS arguments (``blockagg.tls.tls_arguments``)."""
        from clickhouse_driver import Client

        self.address = f"{host}:{port}"
        self.settings = dict(settings or {})
        self._client = Client(host=host, port=port, user=user, password=password,
                              connect_timeout=timeout, send_receive_timeout=max(timeout, 300),
                              settings=self.settings, **(tls or {}))
        self._marked: dict[str, bool] = {}

    def _query(self, query: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        try:
            rows: list[Any] = self._client.execute(query, params)
        except Exception as exc:
            raise self._error(exc) from exc
        return rows

    def _error(self, exc: BaseException) -> AuditError:
        from clickhouse_driver.errors import NetworkError, SocketTimeoutError

        if isinstance(exc, NetworkError | SocketTimeoutError | OSError | EOFError):
            if "SSL" in str(exc) or "certificate" in str(exc).lower():
                from blockagg.cli_tls import TLS_FIX

                return AuditError(
                    f"TLS with ClickHouse at {self.address} failed: {exc}; check {TLS_FIX}")
            return AuditError(f"cannot reach ClickHouse at {self.address}: {exc}; check "
                              "--clickhouse (HOST:PORT of the native protocol, e.g. 9000)")
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return AuditError(f"ClickHouse at {self.address} refused the audit query: {message}")

    def coordinate_tables(self, databases: list[str]) -> list[str]:
        where = "database NOT IN ('system')" if not databases else "database IN %(dbs)s"
        rows = self._query(
            f"SELECT database, table FROM system.columns WHERE {where} AND name IN "
            "('_topic', '_partition', '_offset') GROUP BY database, table "
            "HAVING count() = 3 ORDER BY database, table", {"dbs": tuple(databases)})
        return [f"{d}.{t}" for d, t in rows if is_table_name(f"{d}.{t}")]

    def missing_coordinates(self, table: str) -> list[str]:
        database, name = table.split(".", 1)
        rows = self._query("SELECT name FROM system.columns WHERE database = %(d)s AND "
                           "table = %(t)s", {"d": database, "t": name})
        present = {str(r[0]) for r in rows}
        return [c for c in COORDINATE_COLUMNS if c not in present]

    def table_exists(self, table: str) -> bool:
        database, name = table.split(".", 1)
        return bool(self._query("SELECT 1 FROM system.tables WHERE database = %(d)s AND "
                                "name = %(t)s", {"d": database, "t": name}))

    def marked_tables(self, tables: list[str]) -> frozenset[str]:
        """Those of ``tables`` with the topic-incarnation column (``_incarnation``, or
        ``incarnation`` in a dead-letter table), read once per table."""
        unknown = [t for t in tables if t not in self._marked]
        for table in unknown:
            database, name = table.split(".", 1)
            rows = self._query("SELECT name FROM system.columns WHERE database = %(d)s AND "
                               "table = %(t)s AND name IN ('_incarnation', 'incarnation')",
                               {"d": database, "t": name})
            self._marked[table] = bool(rows)
        return frozenset(t for t in tables if self._marked[t])

    @staticmethod
    def counts_query(tables: list[str], dead_letter_table: str | None,
                     marked: frozenset[str] = frozenset()) -> str:
        """``marked`` tables count only rows of the topic's incarnation
        ``%(incarnation)s`` (or 0: written before the table had the column): a recreated
        topic's earlier rows at the same coordinates are another topic's."""
        def own(table: str, column: str) -> str:
            return (f" AND `{column}` IN (%(incarnation)s, 0)" if table in marked else "")

        parts = [
            f"SELECT toUInt64(_offset) AS o, '{t}' AS t, count() AS c FROM {_quote(t)} "
            "WHERE _topic = %(topic)s AND _partition = %(partition)s AND _offset >= %(start)s"
            f"{own(t, '_incarnation')} GROUP BY o"
            for t in tables
        ]
        if dead_letter_table is not None:
            parts.append(
                f"SELECT toUInt64(`offset`) AS o, '{dead_letter_table}' AS t, count() AS c "
                f"FROM {_quote(dead_letter_table)} WHERE topic = %(topic)s AND "
                "`partition` = %(partition)s AND `offset` >= %(start)s"
                f"{own(dead_letter_table, 'incarnation')} GROUP BY o")
        return "SELECT o, t, c FROM (" + " UNION ALL ".join(parts) + ") ORDER BY o, t"

    def counts(self, tables: list[str], dead_letter_table: str | None, topic: str,
               partition: int, start: int, incarnation: int | None = None
               ) -> Iterator[tuple[int, str, int]]:
        if not tables and dead_letter_table is None:
            return
        every = [*tables, *([dead_letter_table] if dead_letter_table else [])]
        marked = self.marked_tables(every) if incarnation is not None else frozenset()
        query = self.counts_query(tables, dead_letter_table, marked)
        params = {"topic": topic, "partition": partition, "start": start,
                  **({"incarnation": incarnation} if marked else {})}
        try:
            for offset, table, rows in self._client.execute_iter(query, params):
                yield int(offset), str(table), int(rows)
        except AuditError:
            raise
        except Exception as exc:
            self._client.disconnect()
            raise self._error(exc) from exc

    def close(self) -> None:
        self._client.disconnect()

    def __enter__(self) -> ClickHouseAuditReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
