"""Errors of the rows stage (how a message becomes typed columns and dead-letter
decisions): a ClickHouse type it cannot read, a live table that no longer matches a
pinned plan, too many dead letters. Raised before anything is committed or inserted;
each carries the value at fault and says what to change."""

from __future__ import annotations

from blockagg.exceptions import BlockaggError


class RowsError(BlockaggError):
    """Base of the rows stage's errors."""


class TypeParseError(RowsError):
    """A ClickHouse column type we can't parse or don't support."""


class DeadLetterRateExceeded(RowsError):
    """Too large a share of the messages became dead letters: likely a bad deploy
    (a producer writing an unregistered table or a new schema without registering
    it), which should stop the job rather than silently divert everything."""

    def __init__(self, rate: float, max_rate: float, dead: int, total: int,
                 reasons: list[tuple[str, int]], scope: str, min_messages: int,
                 table: str) -> None:
        self.rate = rate
        self.max_rate = max_rate
        self.dead = dead
        self.total = total
        self.reasons = reasons
        self.scope = scope
        top = ", ".join(f"{r} ({n})" for r, n in reasons) or "(none reported)"
        super().__init__(
            f"dead-letter rate {rate:.1%} ({dead} of {total} messages{scope}) is above "
            f"dead_letters.max_rate = {max_rate:.1%} (checked from {min_messages} messages "
            f"on); top reasons: {top}. Nothing is lost: those messages are in {table} "
            "with their reason. Fix the producers or the schema registry (ba-schema list, "
            "ba-schema check TABLE), then restart the job; or raise dead_letters.max_rate "
            "if this share is expected")


class ColumnsChanged(RowsError):
    """The live table no longer has a column, with its type, that a registered
    version's insert plan writes: inserting would change what a replay sends, so the
    batch is refused before anything is committed or inserted."""
