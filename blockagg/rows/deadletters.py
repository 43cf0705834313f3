"""Dead letters: messages that can't be delivered, kept exactly once with the reason.

A dead letter is one row of the dead-letter table (table id 0,
:data:`aggregator.core.metadata.DEAD_LETTER_TABLE_ID`), written through the same
block mechanism as every other table, so a retried dead-letter block is identical
and deduplicated like any block. Every column is a function of the Kafka message
alone; in particular ``time`` is the message's Kafka timestamp, never ``now()``.
The optional ``incarnation`` column (``UInt64``, in :func:`dead_letter_ddl`) gets the
batch's topic incarnation from the writer, as ``_incarnation`` in a table: a recreated
topic's dead letter at the same coordinates is then another row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

DEFAULT_TABLE: Final = "blockagg.dead_letters"
COLUMNS: Final = ("table", "topic", "partition", "offset", "error", "raw", "time")
MAX_ERROR_CHARS: Final = 2000


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One undeliverable message; the payload of a table-id-0 message in a Batch."""

    table: str
    topic: str
    partition: int
    offset: int
    error: str
    raw: bytes
    timestamp_ms: int

    def row(self) -> tuple[Any, ...]:
        """The row in :data:`COLUMNS` order (``time`` in whole seconds, UTC)."""
        return (self.table, self.topic, self.partition, self.offset, self.error, self.raw,
                max(0, self.timestamp_ms // 1000))


def make_dead_letter(topic: str, partition: int, offset: int, timestamp_ms: int,
                     raw: bytes | None, error: str, table: str = "") -> DeadLetter:
    """The dead letter for a message that can't be delivered.

    Call it when the envelope or a row doesn't decode, the table is unknown, the
    schema version is unknown, or a value doesn't convert. ``raw`` is the whole Kafka
    message value (None for a tombstone); ``timestamp_ms`` its Kafka timestamp.
    """
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 3] + "..."
    return DeadLetter(table, topic, partition, offset, error, bytes(raw or b""),
                      timestamp_ms)


def dead_letter_ddl(table: str = DEFAULT_TABLE, replicated: bool = True,
                    zk_path: str = "/clickhouse/tables/{shard}/{database}/{table}",
                    replica: str = "{replica}") -> str:
    """``CREATE TABLE`` for the dead-letter table (works on 18.16 and newer; the
    ``{database}``/``{table}`` macros are expanded here, since 18.16 lacks them)."""
    database, name = table.split(".", 1)
    path = zk_path.replace("{database}", database).replace("{table}", name)
    engine = (f"ReplicatedMergeTree('{path}', '{replica}')" if replicated else "MergeTree()")
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    `table` String,\n    topic String,\n    partition UInt32,\n"
        "    offset UInt64,\n    error String,\n    raw String,\n    time DateTime,\n"
        "    incarnation UInt64 DEFAULT 0\n"
        f") ENGINE = {engine}\nPARTITION BY toYYYYMM(time)\n"
        "ORDER BY (topic, partition, offset)"
    )
