"""Errors of the ClickHouse adapter. Each carries the table or value at fault and
says what to change."""

from __future__ import annotations

from aggregator.exceptions import BlockaggError


class ClickHouseError(BlockaggError):
    """Base of the ClickHouse adapter's errors."""


class TypeParseError(ClickHouseError):
    """A ClickHouse column type we can't parse or don't support."""


class DedupNotConfigured(ClickHouseError):
    """A table would not drop a retried block; inserting into it could duplicate."""


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
