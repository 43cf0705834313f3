"""Task-side preparation of one partition's messages for the core: envelope parsing,
registry lookup, vectorised decoding per (table, version), and dead letters.

:func:`prepare` returns the per-message arrays a :class:`aggregator.core.model.Batch`
needs. Every decision is a pure function of the messages, the registry snapshot and
the live columns captured at startup, so a replayed micro-batch prepares identically.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aggregator.clickhouse.deadletters import DEFAULT_TABLE, DeadLetter, make_dead_letter
from aggregator.clickhouse.rows import Column, Rows, TablePlan, decode_messages, make_plan
from aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from proto.envelope import Parsed, parse_envelope
from proto.exceptions import ProtoError
from proto.registry import Registry


@dataclass(frozen=True)
class Message:
    """One Kafka record of the partition, as Spark hands it over."""

    offset: int
    timestamp_ms: int
    value: bytes | None


@dataclass(frozen=True, eq=False)
class Prepared:
    """Arrays for :class:`aggregator.core.model.Batch`, one element per message."""

    offsets: npt.NDArray[np.int64]
    table_ids: npt.NDArray[np.int64]
    row_counts: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    payloads: list[Rows | DeadLetter]
    tables: dict[int, str]

    @property
    def dead_letters(self) -> int:
        return int(np.count_nonzero(self.table_ids == DEAD_LETTER_TABLE_ID))


class Plans:
    """Insert plans per (table, version), built lazily from the registry and the
    table's live columns (``columns(table)``, read once per table per run)."""

    def __init__(self, registry: Registry, columns: Callable[[str], Sequence[Column]]) -> None:
        self.registry = registry
        self._columns = columns
        self._live: dict[str, Sequence[Column]] = {}
        self._plans: dict[tuple[str, int], tuple[TablePlan, list[str]]] = {}

    def plan(self, table: str, version: int) -> tuple[TablePlan, list[str]]:
        """Raises :class:`proto.exceptions.UnknownTable`/``UnknownVersion``."""
        reg = self.registry.get(table)
        resolved = reg.version(version)
        key = (table, resolved.version)
        if key not in self._plans:
            if table not in self._live:
                self._live[table] = self._columns(table)
            self._plans[key] = make_plan(table, reg.table_id, resolved.version,
                                         resolved.descriptor, self._live[table])
        return self._plans[key]


def prepare(topic: str, partition: int, messages: Sequence[Message], plans: Plans,
            dead_letter_table: str = DEFAULT_TABLE) -> Prepared:
    """Classify and decode ``messages`` (in offset order)."""
    n = len(messages)
    table_ids = np.zeros(n, dtype=np.int64)
    row_counts = np.ones(n, dtype=np.int64)
    sizes = np.fromiter((len(m.value or b"") for m in messages), dtype=np.int64, count=n)
    payloads: list[Any] = [None] * n
    groups: dict[tuple[str, int], list[tuple[int, Parsed]]] = {}

    def dead(i: int, error: str, table: str = "") -> None:
        m = messages[i]
        payloads[i] = make_dead_letter(topic, partition, m.offset, m.timestamp_ms, m.value,
                                       error, table)
        table_ids[i] = DEAD_LETTER_TABLE_ID
        row_counts[i] = 1

    for i, m in enumerate(messages):
        parsed = parse_envelope(m.value)
        if not isinstance(parsed, Parsed):
            dead(i, parsed.reason, parsed.table)
            continue
        try:
            plan, problems = plans.plan(parsed.table, parsed.version)
        except ProtoError as exc:
            dead(i, str(exc), parsed.table)
            continue
        if problems:
            dead(i, f"schema version {plan.version} no longer matches the table: "
                    f"{'; '.join(problems)}", parsed.table)
            continue
        groups.setdefault((parsed.table, plan.version), []).append((i, parsed))
    tables: dict[int, str] = {}
    for (table, version), members in groups.items():
        plan, _ = plans.plan(table, version)
        results = decode_messages(plan, [p.rows for _, p in members])
        for (i, _p), result in zip(members, results, strict=True):
            if isinstance(result, str):
                dead(i, f"{table} v{version}: {result}", table)
            else:
                payloads[i] = result
                table_ids[i] = plan.table_id
                row_counts[i] = result.count
                tables[plan.table_id] = table
    if (table_ids == DEAD_LETTER_TABLE_ID).any():
        tables[DEAD_LETTER_TABLE_ID] = dead_letter_table
    offsets = np.fromiter((m.offset for m in messages), dtype=np.int64, count=n)
    return Prepared(offsets, table_ids, row_counts, sizes, payloads, tables)
