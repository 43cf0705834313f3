"""In-memory stand-ins for Kafka's offset commits and ClickHouse's block
deduplication, plus a way to build batches and to crash a run at a chosen operation.

:class:`DedupSink` behaves like a replicated ClickHouse table: an insert whose token
is among the table's last ``window`` tokens is dropped
(``replicated_deduplication_window``), anything else lands.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from blockagg.aggregator.core.metadata import NO_PINS, Metadata, Pins, decode, is_blockagg
from blockagg.aggregator.core.model import (
    Batch,
    Block,
    BlockSink,
    Committed,
    Lanes,
    MetadataStore,
)
from blockagg.aggregator.core.protocol import SERIAL, Plan, run_batch

Message = tuple[int, int, int]
"""(offset, table id, rows) of one Kafka message."""


class Crash(Exception):
    """An injected failure: the process dies here."""


def table_name(table_id: int) -> str:
    return f"db.t{table_id}"


def make_batch(
    messages: Sequence[Message],
    start: int,
    end: int,
    *,
    topic: str = "events",
    partition: int = 0,
    partition_end: int | None = None,
    bytes_per_row: int = 10,
    pins: Pins = NO_PINS,
) -> Batch:
    """The messages of ``messages`` inside ``[start, end)`` as one partition's batch."""
    inside = [m for m in messages if start <= m[0] < end]
    offsets = np.array([m[0] for m in inside], dtype=np.int64)
    table_ids = np.array([m[1] for m in inside], dtype=np.int64)
    rows = np.array([m[2] for m in inside], dtype=np.int64)
    return Batch(
        topic=topic,
        partition=partition,
        start=start,
        end=end,
        offsets=offsets,
        table_ids=table_ids,
        row_counts=rows,
        sizes=rows * bytes_per_row,
        payloads=[None] * len(inside),
        tables={t: table_name(t) for t in sorted(set(table_ids.tolist()))},
        partition_end=partition_end,
        pins=pins,
    )


@dataclass
class MemoryMetadataStore:
    """A consumer group's offset commits for any number of partitions, with history."""

    commits: dict[tuple[str, int], Committed] = field(default_factory=dict)
    history: list[tuple[str, int, Committed]] = field(default_factory=list)

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.commits.get((topic, partition))

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        entry = Committed(offset, metadata)
        self.commits[(topic, partition)] = entry
        self.history.append((topic, partition, entry))

    def metadata_history(self, topic: str = "events", partition: int = 0) -> list[Metadata]:
        """Our commits of one partition, in commit order (foreign ones left out)."""
        return [
            decode(c.metadata)
            for t, p, c in self.history
            if (t, p) == (topic, partition) and is_blockagg(c.metadata)
        ]


@dataclass
class DedupSink:
    """ClickHouse tables that drop a block whose token is among their last ``window``."""

    window: int = 100
    rows: Counter[tuple[str, int, int]] = field(default_factory=Counter)
    tokens: dict[str, deque[str]] = field(default_factory=dict)
    inserted: list[Block] = field(default_factory=list)
    deduplicated: list[Block] = field(default_factory=list)

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        recent = self.tokens.setdefault(block.table, deque(maxlen=self.window))
        if block.token in recent:
            self.deduplicated.append(block)
            return
        recent.append(block.token)
        self.inserted.append(block)
        for position in block.positions.tolist():
            offset = int(batch.offsets[position])
            for row in range(int(batch.row_counts[position])):
                self.rows[(block.table, offset, row)] += 1

    def duplicates(self) -> list[tuple[str, int, int]]:
        return [key for key, count in self.rows.items() if count > 1]


def expected_rows(messages: Sequence[Message]) -> Counter[tuple[str, int, int]]:
    """Every row of every message, once."""
    return Counter(
        (table_name(table_id), offset, row)
        for offset, table_id, rows in messages
        for row in range(rows)
    )


class Crasher:
    """Wraps a store and a sink so that operation number ``at`` of a run crashes:
    just before it is applied (``after=False``), or just after, as when the broker's
    or ClickHouse's acknowledgement is lost on the way back (``after=True``)."""

    def __init__(self, store: MetadataStore, sink: BlockSink, at: int, after: bool) -> None:
        self.store = store
        self.sink = sink
        self.at = at
        self.after = after
        self.count = 0

    def _crash_if(self, after: bool) -> None:
        if self.count == self.at and self.after == after:
            raise Crash(f"{'after' if after else 'before'} operation {self.at}")

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.store.committed(topic, partition)

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self._crash_if(after=False)
        self.store.commit(topic, partition, offset, metadata)
        self._crash_if(after=True)
        self.count += 1

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self._crash_if(after=False)
        self.sink.insert(block, batch)
        self._crash_if(after=True)
        self.count += 1


class InFlightLanes:
    """Concurrent insert lanes, modelled deterministically: an event's inserts run in
    a seeded random order (any order lanes could finish them in), and when one fails,
    a seeded random share of the others still lands (they were already in flight),
    before the first failure is raised, as :class:`~aggregator.lanes.ThreadLanes`
    does. Every subset of an event's blocks can thus be in ClickHouse when it fails."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def run(self, inserts: Sequence[Callable[[], None]]) -> None:
        order = list(range(len(inserts)))
        self.random.shuffle(order)
        failures: dict[int, BaseException] = {}
        for index in order:
            if failures and self.random.random() < 0.5:
                continue
            try:
                inserts[index]()
            except Crash as exc:
                failures[index] = exc
        if failures:
            raise failures[min(failures)]


def run_crashing(
    plan: Plan, store: MetadataStore, sink: BlockSink, at: int | None, after: bool = False,
    lanes: Lanes = SERIAL,
) -> bool:
    """Run ``plan``, crashing at operation ``at`` if given; True if it completed."""
    if at is None:
        run_batch(plan, store, sink, lanes=lanes)
        return True
    crasher = Crasher(store, sink, at, after)
    try:
        run_batch(plan, crasher, crasher, lanes=lanes)
    except Crash:
        return False
    return True


def metadata_of_length(length: int) -> Metadata:
    """Metadata whose encoding is exactly ``length`` characters long: a binary search
    finds the most blocks whose smallest encoding still fits, then the run id's width
    (msgpack's 1, 2, 3, 5 or 9 bytes) and the batch id's fine-tune it over the last
    few block counts. Not every length exists (base85 never ends a string with a
    group of one character)."""
    from blockagg.aggregator.core.metadata import BlockRange, encode

    start, end = 1_000_000, 1_100_000
    widths = (0, 200, 60_000, 2**31, 2**63)

    def metadata(count: int, run: int, batch: int) -> Metadata:
        blocks = tuple(BlockRange(t, start + (t * 7_919) % 50_000,
                                  end - 1 - (t * 104_729) % 50_000) for t in range(1, count + 1))
        return Metadata(run, batch, start, end, start, blocks)

    def size(m: Metadata) -> int:
        return len(encode(m, max_bytes=1 << 20))

    low, high = 1, 4000
    while low < high:
        mid = (low + high + 1) // 2
        if size(metadata(mid, 0, 0)) <= length:
            low = mid
        else:
            high = mid - 1
    for count in range(max(1, low - 4), low + 1):
        for run in widths:
            for batch in widths[:4]:
                candidate = metadata(count, run, batch)
                if size(candidate) == length:
                    return candidate
    raise ValueError(f"no metadata encodes to {length} characters")
