"""The data the core works on, and the two interfaces its operations run against.

A :class:`Batch` is one topic-partition's share of one micro-batch, already split
into messages (the envelope is decoded before the core sees it). It is columnar:
one numpy array per attribute, one element per Kafka message, in offset order.
A :class:`Block` is what the core decides to insert: every message of one table
in ``[first, last]`` of one partition, identified by positions into the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from blockagg.aggregator.core.metadata import NO_PINS, BlockRange, Pins
from blockagg.exceptions import ConfigError

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Batch:
    """One partition's messages of one micro-batch, planned as ``[start, end)``.

    ``end`` is the planned end of the range (Spark's until offset), not the last
    message + 1: the range may end, or have holes, in offsets that carry no visible
    message (transaction markers, aborted or compacted records).

    Per message ``i`` (arrays of equal length, ``offsets`` strictly increasing and
    inside ``[start, end)``): ``table_ids[i]`` is the table's stable id (0 is the
    dead-letter table), ``row_counts[i]`` the number of rows it carries and
    ``sizes[i]`` its encoded size in bytes. ``payloads[i]`` is opaque to the core
    and handed to the sink (``blockagg.rows.prepare.prepare`` makes it: a
    decoded ``Rows`` slice, or a ``DeadLetter`` for table id 0; ``prepare_envelopes``
    gives a ``Payloads`` sequence of the same items, made on demand). ``tables`` maps
    every table id present to its ``database.table`` name. ``partition_end`` is the
    partition's log-end offset when known; it lets the core notice metadata that is
    ahead of the partition. ``pins`` are what the batch was prepared under besides
    its messages (registry position, topic incarnation, deduplication mode): a batch
    that replays an intent must carry that intent's pins (see
    :func:`aggregator.core.protocol.batch_pins`). ``abandoned`` are replay blocks the
    operator gave up rebuilding (``ReplayBlockMissing``): the task routed their
    surviving messages to the dead-letter table, and the core treats every other
    message of their table up to their last offset as delivered.
    """

    topic: str
    partition: int
    start: int
    end: int
    offsets: Int64Array
    table_ids: Int64Array
    row_counts: Int64Array
    sizes: Int64Array
    payloads: Sequence[object]
    tables: Mapping[int, str]
    partition_end: int | None = None
    pins: Pins = NO_PINS
    abandoned: tuple[BlockRange, ...] = ()

    def __len__(self) -> int:
        return int(self.offsets.shape[0])


@dataclass(frozen=True, eq=False)
class Block:
    """A sealed block: the messages of one table in ``[first, last]``, in order.

    ``positions`` index the batch's arrays. ``token`` is the deduplication token, a
    pure function of (topic incarnation, topic, partition, table, first, last), so a
    retried block carries the same one. ``replay`` is True when the block is rebuilt from the
    committed metadata rather than newly formed; ``since_s`` is then when its first
    attempt may have been sent, at the earliest (the intent's ``Metadata.since_s``,
    seconds since the epoch; ``0``: unknown), so the writer can tell a replay the server
    may have forgotten (``docs/protocol.md``, *Limits*).
    """

    topic: str
    partition: int
    table_id: int
    table: str
    first: int
    last: int
    positions: Int64Array
    rows: int
    size: int
    token: str
    replay: bool = False
    since_s: int = 0

    @property
    def messages(self) -> int:
        return int(self.positions.shape[0])


def block_token(topic: str, partition: int, table: str, first: int, last: int,
                incarnation: int = 0) -> str:
    """The block's ``insert_deduplication_token``: readable, and a pure function of
    the block's coordinates, so every retry of the block sends the same token.

    With the topic's incarnation (:func:`aggregator.core.metadata.incarnation_of`,
    pinned in the metadata) the token differs between a topic and its recreation, or
    the same topic name on two clusters; ``0`` (metadata written before pins existed)
    gives the earlier format, so an intent committed by an earlier version replays
    with the token its first attempt sent."""
    if incarnation:
        return f"blockagg:{incarnation:016x}:{topic}:{partition}:{table}:{first}-{last}"
    return f"blockagg:{topic}:{partition}:{table}:{first}-{last}"


@dataclass(frozen=True, slots=True)
class Committed:
    """What the group has committed for one partition: the offset and its metadata."""

    offset: int
    metadata: str = field(default="")


class MetadataStore(Protocol):
    """Where metadata is committed: the consumer group's offset commits in Kafka.

    ``commit`` returns only once the broker has durably accepted the commit, and
    raises otherwise; a commit that raised may or may not have been applied.
    """

    def committed(self, topic: str, partition: int) -> Committed | None: ...

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None: ...


class Fence(Protocol):
    """One attempt's hold on a partition (invariant 6): ``confirm`` raises unless the
    partition's last commit is still the intent this attempt wrote, so an attempt that
    a newer one has overtaken inserts nothing (``aggregator.kafka.fencing``). It returns
    the (monotonic) time at which the read that confirmed began: the attempt was the
    partition's only writer then, and the sink judges its send's lateness from it."""

    def confirm(self, topic: str, partition: int) -> float: ...


class Lanes(Protocol):
    """How the inserts of one seal event run: one after another (``SERIAL``,
    ``aggregator.core.protocol``) or several at once (``aggregator.lanes.ThreadLanes``).

    ``run`` returns only once every insert it started has ended; if any raised, it
    starts no further insert and raises the first failure (in the order given), so
    the batch fails and its retry replays the event. The blocks of one event are
    listed by the intent committed before it and belong to distinct tables, so the
    order among them changes nothing (``docs/protocol.md``, *Concurrent inserts*).
    """

    def run(self, inserts: Sequence[Callable[[], None]]) -> None: ...


class BlockSink(Protocol):
    """Where blocks go: ClickHouse, one insert per block.

    ``insert`` returns only once the block is acknowledged (with the configured
    quorum). Inserting a block that was inserted before is a no-op on the server
    (block deduplication), which is what makes retries safe.
    """

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        """``confirmed_at``: what the fence's ``confirm`` returned before this insert
        (``None`` without a fence)."""


@runtime_checkable
class BuildAheadSink(BlockSink, Protocol):
    """A :class:`BlockSink` that can build a seal event's inserts ahead of sending them.

    The executor calls ``build_ahead`` once per seal event, on its own thread, with the
    event's blocks in the order the lanes take them, after the intent listing them is
    committed and before the first of them is inserted. It is a hint: it sends
    nothing, and a sink may build any number of the blocks (or none) and must build
    exactly what ``insert`` would (a block's insert is a pure function of the block and
    the batch, invariant 3). A block that fails to build is left to its ``insert``,
    which raises as it would have."""

    def build_ahead(self, blocks: Sequence[Block], batch: Batch) -> None: ...


BATCHES_IN_FLIGHT = 2
"""Batches that can insert into a table between a block's first attempt and its replay:
the batch whose block failed, and the one that replays it (a task retry runs inside
the batch; a restart replays before any new batch)."""


@dataclass(frozen=True, slots=True)
class BlockShare:
    """A table's share of its deduplication window, for one partition-batch.

    ``window`` is the table's deduplication window in blocks, ``partitions`` the
    number of partitions of every topic writing the table's shard. Each of them forms
    at most :attr:`blocks` blocks of the table per batch, so at most
    ``BATCHES_IN_FLIGHT x partitions x blocks <= window`` blocks reach the table
    between a block's first attempt and its replay
    (``aggregator.clickhouse.dedup_window``)."""

    table_id: int
    window: int
    partitions: int

    @property
    def blocks(self) -> int:
        """``floor(window / (BATCHES_IN_FLIGHT x partitions))``: 0 holds no block."""
        return self.window // (BATCHES_IN_FLIGHT * max(self.partitions, 1))


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a table's buffer seals into a block, and how large a commit may be.

    A buffer seals when adding a message makes it reach ``max_rows`` rows or
    ``max_bytes`` bytes. Only message content counts, never time, so a retry of the
    same messages seals at the same places. ``max_metadata_bytes`` is the broker's
    ``offset.metadata.max.bytes``. ``max_blocks_per_table``: the tables whose blocks
    per partition-batch are bounded by their share of the deduplication window (a
    batch forming more is refused, :class:`~aggregator.core.exceptions.TooManyBlocks`);
    a table not listed is not bounded. The shares never change the blocks, only
    whether a batch is taken.
    """

    max_rows: int
    max_bytes: int
    max_metadata_bytes: int = 4096
    max_blocks_per_table: tuple[BlockShare, ...] = ()

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.max_bytes < 1:
            raise ConfigError(
                f"block thresholds must be >= 1, got max_rows={self.max_rows} "
                f"max_bytes={self.max_bytes}"
            )
