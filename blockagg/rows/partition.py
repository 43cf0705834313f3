"""The rows stage's one entry: a partition's messages of one micro-batch -> the core's
:class:`~aggregator.core.model.Batch` (:func:`prepare_partition`).

Everything that turns the messages into the batch happens here, in this order:
envelopes (parsed in bulk), the pins the batch is prepared under (a replay keeps its
intent's: :func:`~aggregator.core.protocol.batch_pins`), the registry view as of
``Pins.registry``, decoded typed columns (:mod:`blockagg.rows.prepare`), dead letters,
and the operator's abandoned blocks routed to the dead-letter table. Invariants 3 and 5:
every decision is a pure function of the messages, the committed metadata and the
settings; what the adapters know (the shard's deduplication mode, the topic
incarnation, the live columns) reaches this stage only through callables the Spark
shell passes in (``pins_now``, ``plans``), so this layer imports neither the adapters
nor Spark (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID, NO_PINS, BlockRange, Pins
from blockagg.aggregator.core.model import Batch, Committed
from blockagg.aggregator.core.protocol import batch_pins
from blockagg.config import MissingBlock
from blockagg.proto.envelope import Envelopes, Parsed, Rejected, parse_envelope, parse_envelopes
from blockagg.rows.deadletters import DeadLetter, make_dead_letter
from blockagg.rows.prepare import Plans


class MessageRange(Protocol):
    """The planned ``[start, end)`` of a partition in a micro-batch (the Spark shell's
    ``PlannedRange``): ``exact_start`` False lowers the start to the first message."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def exact_start(self) -> bool: ...


class TableIds(Protocol):
    """Table name -> stable table id (>= 1), ``None`` when not registered: the plain
    registry of :func:`build_batch` (a test double's)."""

    def table_id(self, table: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Message:
    """The payload of one message routed to a table by :func:`build_batch`: its
    envelope, parsed (decoded later by the sink)."""

    parsed: Parsed
    timestamp_ms: int


PinsNow = Callable[[Envelopes | list[Parsed | Rejected], Sequence[int]], Pins]
"""What a batch that replays nothing is prepared under now, given its envelopes and
timestamps (the shell's ``current_pins`` over its components)."""


def full_registry(registry: Any) -> bool:
    """Whether ``registry`` is a schema registry (snapshots, reload) rather than a plain
    :class:`TableIds`: only then are messages decoded into typed columns here."""
    return hasattr(registry, "reload") and hasattr(registry, "current")


def positioned(registry: Any) -> bool:
    """Whether ``registry`` pins positions (:class:`proto.registry.RegistryCache`)."""
    return all(hasattr(registry, m) for m in ("current", "position", "at"))


def prepare_partition(
    rng: MessageRange,
    offsets: Sequence[int],
    values: Sequence[bytes | None],
    timestamps_ms: Sequence[int],
    committed: Committed | None,
    registry: Any,
    pins_now: PinsNow,
    plans: Callable[[], Plans],
    dead_letter_table: str,
    missing_blocks: Sequence[MissingBlock] = (),
    partition_end: int | None = None,
) -> Batch:
    """The partition's :class:`Batch`, prepared under the pins it must keep.

    ``committed``: the partition's last commit, read before anything else, so a
    replay is prepared under its intent's pins; ``pins_now`` gives those of a batch
    that replays nothing; ``plans`` the worker's decode plans (called only for a
    schema registry); ``missing_blocks``: ``job.dead_letter_missing_blocks``;
    ``partition_end``: the log-end offset the driver read (``Batch.partition_end``)."""
    full = full_registry(registry)
    parsed: Envelopes | list[Parsed | Rejected] = parse_envelopes(values) if full else []
    current = pins_now(parsed, timestamps_ms if full else [])
    pins = batch_pins(rng.topic, rng.partition, committed, current)
    if full:
        batch = decode_batch(rng, offsets, values, timestamps_ms, registry, plans(),
                             dead_letter_table, pins, parsed)
    else:
        batch = build_batch(rng, offsets, values, timestamps_ms, registry,
                            dead_letter_table, pins)
    if partition_end is not None:
        batch = replace(batch, partition_end=partition_end)
    return route_missing_blocks(batch, missing_blocks, dead_letter_table, values,
                                timestamps_ms)


def build_batch(
    rng: MessageRange,
    offsets: Sequence[int],
    values: Sequence[bytes | None],
    timestamps_ms: Sequence[int],
    registry: TableIds,
    dead_letter_table: str,
    pins: Pins = NO_PINS,
) -> Batch:
    """The core's columnar :class:`Batch` for one partition's rows (offset order)
    over a plain :class:`TableIds` registry.

    Payloads: :class:`Message` for a message routed to a table, a
    :class:`~blockagg.rows.deadletters.DeadLetter` (table id 0) for one that
    can't be: a malformed envelope or an unregistered table. Every decision is a pure
    function of the message and the registry, so a replay classifies alike.
    """
    n = len(offsets)
    table_ids = np.zeros(n, dtype=np.int64)
    row_counts = np.ones(n, dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    payloads: list[Message | DeadLetter] = []
    tables: dict[int, str] = {}
    for i, (offset, value, ts) in enumerate(zip(offsets, values, timestamps_ms, strict=True)):
        sizes[i] = len(value) if value is not None else 0
        result = parse_envelope(value)
        reason: Rejected | None = None
        if isinstance(result, Parsed):
            table_id = registry.table_id(result.table)
            if table_id is not None:
                table_ids[i] = table_id
                row_counts[i] = len(result.rows)
                tables[table_id] = result.table
                payloads.append(Message(result, ts))
                continue
            reason = Rejected(f"table {result.table} is not registered in the schema registry",
                              table=result.table)
        else:
            reason = result
        payloads.append(make_dead_letter(rng.topic, rng.partition, offset, ts, value,
                                         reason.reason, reason.table))
        tables[DEAD_LETTER_TABLE_ID] = dead_letter_table
    start = rng.start if rng.exact_start or n == 0 else min(rng.start, offsets[0])
    return Batch(
        topic=rng.topic,
        partition=rng.partition,
        start=start,
        end=rng.end,
        offsets=np.asarray(offsets, dtype=np.int64),
        table_ids=table_ids,
        row_counts=row_counts,
        sizes=sizes,
        payloads=payloads,
        tables=tables,
        pins=pins,
    )


def decode_batch(
    rng: MessageRange,
    offsets: Sequence[int],
    values: Sequence[bytes | None],
    timestamps_ms: Sequence[int],
    registry: Any,
    plans: Plans,
    dead_letter_table: str,
    pins: Pins = NO_PINS,
    parsed: Sequence[Parsed | Rejected] | Envelopes | None = None,
) -> Batch:
    """The :class:`Batch` through the data path (``blockagg.rows.prepare``):
    envelopes (parsed in bulk), registry as of ``pins.registry``, vectorised decoding
    with each version's registered columns (checked against the live ones), dead
    letters.

    ``pins.registry`` 0 (not pinned) decides with the worker's snapshot, re-read
    when a message needs a newer one, as before pins existed. ``parsed``: the
    envelopes when the caller has them (:func:`~proto.envelope.parse_envelopes`; a
    list of :func:`~proto.envelope.parse_envelope` results takes the per-message
    path, the same decisions)."""
    from blockagg.proto.registry import pinned_position
    from blockagg.rows.prepare import Message as Record
    from blockagg.rows.prepare import needs_newer_any, prepare, prepare_envelopes

    plans.expire_live()
    envelopes = parsed if isinstance(parsed, Envelopes) else parse_envelopes(values)
    stamps = np.asarray(timestamps_ms, dtype=np.int64)
    if pins.registry and positioned(registry):
        plans.registry = registry.at(pinned_position(pins.registry))
    else:
        snapshot = registry.current()
        if needs_newer_any(snapshot, envelopes, stamps):
            snapshot = registry.reload()
        plans.registry = snapshot
    if parsed is None or isinstance(parsed, Envelopes):
        prepared = prepare_envelopes(rng.topic, rng.partition, offsets, stamps, values, plans,
                                     dead_letter_table, envelopes=envelopes)
    else:
        records = [Record(int(o), int(t), v)
                   for o, v, t in zip(offsets, values, timestamps_ms, strict=True)]
        prepared = prepare(rng.topic, rng.partition, records, plans,
                           dead_letter_table, parsed=parsed)
    n = len(offsets)
    start = rng.start if rng.exact_start or n == 0 else min(rng.start, offsets[0])
    return Batch(
        topic=rng.topic, partition=rng.partition, start=start, end=rng.end,
        offsets=prepared.offsets, table_ids=prepared.table_ids,
        row_counts=prepared.row_counts, sizes=prepared.sizes,
        payloads=prepared.payloads, tables=prepared.tables, pins=pins,
    )


def route_missing_blocks(batch: Batch, missing_blocks: Sequence[MissingBlock],
                         dead_letter_table: str, values: Sequence[bytes | None],
                         timestamps_ms: Sequence[int]) -> Batch:
    """The batch with the surviving messages of the operator's abandoned blocks
    (``job.dead_letter_missing_blocks``) turned into dead letters, and those blocks
    in ``Batch.abandoned`` (the core then skips the rest of their table up to their
    last offset). A pure function of the messages and the setting, so every retry
    routes alike while the setting stays."""
    mine = [b for b in missing_blocks if (b.topic, b.partition) == (batch.topic, batch.partition)]
    if not mine:
        return batch
    table_ids = batch.table_ids.copy()
    payloads = list(batch.payloads)
    for b in mine:
        hit = np.flatnonzero((table_ids == b.table_id) & (batch.offsets >= b.first)
                             & (batch.offsets <= b.last))
        name = batch.tables.get(b.table_id, f"#{b.table_id}")
        reason = (f"replay block missing: block [{b.first}, {b.last}] of table {name} lost "
                  "messages to retention or compaction; this message may already be in "
                  "the table")
        for i in hit.tolist():
            payloads[i] = make_dead_letter(batch.topic, batch.partition,
                                           int(batch.offsets[i]), int(timestamps_ms[i]),
                                           values[i], reason, name)
        table_ids[hit] = DEAD_LETTER_TABLE_ID
    tables = {**batch.tables, DEAD_LETTER_TABLE_ID: dead_letter_table}
    row_counts = np.where(table_ids != batch.table_ids, 1, batch.row_counts)
    abandoned = tuple(BlockRange(b.table_id, b.first, b.last) for b in mine)
    return replace(batch, table_ids=table_ids, payloads=payloads, tables=tables,
                   row_counts=row_counts, abandoned=abandoned)
