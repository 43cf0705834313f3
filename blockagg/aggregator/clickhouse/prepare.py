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

from blockagg.aggregator.clickhouse.deadletters import DEFAULT_TABLE, DeadLetter, make_dead_letter
from blockagg.aggregator.clickhouse.exceptions import TableNotFound
from blockagg.aggregator.clickhouse.rows import Column, Rows, TablePlan, decode_messages, make_plan
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from blockagg.proto.envelope import LATEST, Parsed, parse_envelope
from blockagg.proto.exceptions import ProtoError
from blockagg.proto.registry import Registry


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
    table's live columns (``columns(table)``, read once per table per run).

    ``reload`` (e.g. :meth:`proto.registry.RegistryCache.reload`) returns a fresh
    registry snapshot; :func:`prepare` calls it, at most once per call, when a
    message names a table or version the snapshot lacks, or carries
    ``schema_version = 0`` with a timestamp the snapshot does not cover
    (:meth:`proto.registry.Registry.covers`). Without it the snapshot is used as is.
    """

    def __init__(self, registry: Registry, columns: Callable[[str], Sequence[Column]],
                 reload: Callable[[], Registry] | None = None) -> None:
        self.registry = registry
        self._columns = columns
        self._reload = reload
        self._live: dict[str, Sequence[Column]] = {}
        self._plans: dict[tuple[str, int], tuple[TablePlan, list[str]]] = {}

    def refresh(self) -> bool:
        """Re-read the registry (when a ``reload`` was given); plans already built
        stay valid, since a registered version never changes."""
        if self._reload is None:
            return False
        self.registry = self._reload()
        return True

    def needs_refresh(self, table: str, version: int, timestamp_ms: int) -> bool:
        """Whether the snapshot may be too old to decide this message."""
        if table not in self.registry:
            return True
        reg = self.registry.get(table)
        if version == LATEST:
            return not self.registry.covers(timestamp_ms)
        return all(v.version != version for v in reg.versions)

    def plan(self, table: str, version: int, timestamp_ms: int | None = None
             ) -> tuple[TablePlan, list[str]]:
        """The plan for a message of ``table`` with ``schema_version = version``.

        With ``timestamp_ms`` (the message's Kafka timestamp), version 0 resolves
        deterministically (:meth:`proto.registry.Registration.resolve`); without it,
        to the snapshot's latest (not replay-safe). Raises
        :class:`proto.exceptions.UnknownTable`/``UnknownVersion``, and
        :class:`aggregator.clickhouse.exceptions.TableNotFound` when the live table
        is gone."""
        reg = self.registry.get(table)
        resolved = (reg.version(version) if timestamp_ms is None
                    else reg.resolve(version, timestamp_ms))
        key = (table, resolved.version)
        if key not in self._plans:
            if table not in self._live:
                self._live[table] = self._columns(table)
            self._plans[key] = make_plan(table, reg.table_id, resolved.version,
                                         resolved.descriptor, self._live[table])
        return self._plans[key]


def prepare(topic: str, partition: int, messages: Sequence[Message], plans: Plans,
            dead_letter_table: str = DEFAULT_TABLE, columnar: bool = True) -> Prepared:
    """Classify and decode ``messages`` (in offset order). ``columnar`` (default)
    converts to numpy columns where it can (:func:`~aggregator.clickhouse.rows.
    decode_messages`); False is the previous per-value path, same values."""
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

    parsed_all = [parse_envelope(m.value) for m in messages]
    if any(isinstance(p, Parsed) and plans.needs_refresh(p.table, p.version, m.timestamp_ms)
           for p, m in zip(parsed_all, messages, strict=True)):
        plans.refresh()
    for i, (m, parsed) in enumerate(zip(messages, parsed_all, strict=True)):
        if not isinstance(parsed, Parsed):
            dead(i, parsed.reason, parsed.table)
            continue
        try:
            plan, problems = plans.plan(parsed.table, parsed.version, m.timestamp_ms)
        except (ProtoError, TableNotFound) as exc:
            dead(i, str(exc), parsed.table)
            continue
        if problems:
            dead(i, f"schema version {plan.version} no longer matches the table: "
                    f"{'; '.join(problems)}", parsed.table)
            continue
        groups.setdefault((parsed.table, plan.version), []).append((i, parsed))
    tables: dict[int, str] = {}
    for (table, version), members in groups.items():
        plan, _ = plans.plan(table, version)  # a resolved version: pinned
        results = decode_messages(plan, [p.rows for _, p in members], columnar)
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
