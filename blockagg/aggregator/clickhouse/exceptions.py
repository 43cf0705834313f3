"""Errors of the ClickHouse adapter. Each carries the table or value at fault and
says what to change."""

from __future__ import annotations

from blockagg.exceptions import BlockaggError


class ClickHouseError(BlockaggError):
    """Base of the ClickHouse adapter's errors."""



class DedupNotConfigured(ClickHouseError):
    """A table would not drop a retried block; inserting into it could duplicate."""


class CoordinatesMissing(DedupNotConfigured):
    """A table without the Kafka coordinate columns on a server that deduplicates by
    content hash: two different blocks with the same rows are one block to it, so the
    second would be lost. Refused unless ``clickhouse.allow_tables_without_coordinates``
    lists the table."""


class IncarnationMissing(CoordinatesMissing):
    """A table that other Kafka clusters feed too (``clickhouse.shared_with_other_kafka_
    clusters``) without the ``_incarnation`` column (``incarnation`` in the dead-letter
    table) on a server that deduplicates by content hash: a block of this cluster whose
    rows and coordinates equal another cluster's block hashes alike, and the second
    is dropped as a retry and lost."""


class DedupWindowTooSmall(ClickHouseError):
    """A table's deduplication window is smaller than the blocks a retried block may
    have to outlive (``aggregator.clickhouse.dedup_window``)."""


class TableNotFound(ClickHouseError):
    """The table does not exist on the replica."""


class InsertFailed(ClickHouseError):
    """A block insert was refused with a non-retriable error, or every attempt
    failed. ``code`` is the server's error code (None for connection errors)."""

    def __init__(self, table: str, code: int | None, message: str, attempts: int) -> None:
        self.table = table
        self.code = code
        self.server_message = message
        self.attempts = attempts
        where = f"code {code}" if code is not None else "connection error"
        super().__init__(
            f"insert into {table} failed after {attempts} attempt(s) ({where}): {message}")


class QuorumUnsatisfied(InsertFailed):
    """Every attempt of a block failed because ``insert_quorum`` could not be reached:
    a replica of the shard is not catching up. The message names the table, each
    replica's state (``system.replicas``, its oldest failing queue entry) and the remedy
    (:func:`aggregator.clickhouse.diagnosis.quorum_error`)."""

    def __init__(self, table: str, code: int | None, message: str, attempts: int,
                 explanation: str) -> None:
        super().__init__(table, code, message, attempts)
        self.args = (explanation,)

    def __str__(self) -> str:
        return str(self.args[0])


class AlterNotApplied(InsertFailed):
    """Every attempt of a block was refused because the replicas had not yet applied an
    ``ALTER`` of the table's columns (ClickHouse 18.16, code 244 ``Bad version`` of the
    table's ``columns`` node). The message says what to check and the remedy for a
    stalled replicated ALTER (:func:`aggregator.clickhouse.diagnosis.alter_error`)."""

    def __init__(self, table: str, code: int | None, message: str, attempts: int,
                 explanation: str) -> None:
        super().__init__(table, code, message, attempts)
        self.args = (explanation,)

    def __str__(self) -> str:
        return str(self.args[0])




class DedupModeMismatch(ClickHouseError):
    """A replay's pinned deduplication mode (token or content hash) can't be kept by
    the server answering: it is on the other side of the ``insert_deduplication_token``
    boundary. Nothing was sent."""


class ReplayAcrossAlter(ClickHouseError):
    """A block must be sent again after its table's columns changed, on a server that
    recognises a stored block by a hash that covers the columns, and the table has no
    Kafka coordinate columns to tell whether the first attempt landed. Nothing was
    sent (``aggregator.clickhouse.structure``)."""


class ReplayBeyondDedupAge(ClickHouseError):
    """A replay block's first attempt may be older than the table's
    ``replicated_deduplication_window_seconds``, so the server may no longer recognise
    it, and the table has no Kafka coordinate columns to tell whether it landed.
    Nothing was sent."""


class CoordinatesInUse(ClickHouseError):
    """A partition starting without a blockagg commit would deliver into a table that
    already holds rows at its coordinates and can't tell them from its own (no
    ``_incarnation`` column, content-hash deduplication): a new block equal to a
    stored one would be dropped (``aggregator.clickhouse.stored``)."""


class ClickHouseUnreachable(ClickHouseError):
    """A replica did not accept a connection (down, wrong host or port, firewall)."""


class ClickHouseTlsFailed(ClickHouseUnreachable):
    """The TLS handshake with a replica failed: an unverifiable certificate, or TLS
    spoken to a plain port."""


class ClickHouseAuthFailed(ClickHouseError):
    """A replica refused the configured user (unknown user or wrong password)."""


class DeadLetterTableInvalid(ClickHouseError):
    """The dead-letter table is missing on a replica or lacks an expected column."""


class RowsAlreadyStored(ClickHouseError):
    """A start would deliver offsets whose rows the shard already stores (another group
    delivered them): refused at start, before anything is written."""
