"""Block formation: route a batch's messages to per-table buffers and seal them.

Formation is a pure function of the batch, the resume offset, the replay blocks of
the committed metadata and the thresholds (the seed's invariant 3, deterministic
blocks), so a retry forms the same blocks at the same places:

* messages below the resume offset are already delivered and skipped;
* for a table with a replay block ``[first, last]``: its messages below ``first``
  are delivered (skipped), those in ``[first, last]`` are rebuilt into exactly that
  block, those after ``last`` start the table's next block;
* every other message goes to its table's open buffer, which seals into a block when
  adding a message makes it reach ``max_rows`` rows or ``max_bytes`` bytes (a message
  is never split: the message that reaches the threshold is the block's last, and a
  message at or above a threshold on its own forms a block alone);
* at the end of the batch (the forced flush point) every open buffer seals.

:func:`form_blocks` does this column-wise with numpy (a stable sort by table, then
cumulative sums and ``searchsorted`` per block: Python work per block, never per
message). :func:`form_blocks_per_message` is the plain per-message loop, kept as the
executable specification: tests check both agree, and the benchmark compares them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from blockagg.aggregator.core.exceptions import ReplayBlockMissing
from blockagg.aggregator.core.metadata import BlockRange
from blockagg.aggregator.core.model import Batch, Block, Int64Array, Thresholds, block_token

REPLAY_EVENT = -1
"""``sealed_at`` of replay blocks: they seal before any message is consumed."""


@dataclass(frozen=True, eq=False)
class Formation:
    """The blocks formed from one batch, in seal order.

    ``sealed_at[i]`` says when ``blocks[i]`` sealed: :data:`REPLAY_EVENT` for a replay
    block, the batch position of the message that made it reach a threshold, or
    ``len(batch)`` for a block sealed at the end of the batch. Blocks are ordered by
    ``(sealed_at, first)``. ``delivered`` counts the messages skipped as delivered.
    """

    blocks: tuple[Block, ...]
    sealed_at: tuple[int, ...]
    delivered: int


def _missing(batch: Batch, replay: BlockRange, name: str) -> ReplayBlockMissing:
    return ReplayBlockMissing(
        f"{batch.topic}[{batch.partition}]: the committed metadata's block of table "
        f"{name!r} (id {replay.table_id}) is [{replay.first}, {replay.last}], but the batch "
        f"[{batch.start}, {batch.end}) has no message of that table at offset "
        f"{replay.first} or {replay.last}: the messages were deleted by "
        "retention or compaction, or the topic was recreated. The block can't be rebuilt "
        "identically, and it may or may not be in ClickHouse. To go on without losing "
        "anything else, restart with --set 'job.dead_letter_missing_blocks="
        f"[\"{batch.topic}:{batch.partition}:{replay.table_id}:{replay.first}-{replay.last}\"]'"
        ": the block's surviving messages go to the dead-letter table (reason: replay "
        "block missing), every other message is delivered as usual (docs/running.md). "
        "Do not reset the group's offset past the block: that would also skip the "
        "undelivered messages of the other tables below it."
    )


def _table_name(batch: Batch, table_id: int) -> str:
    return batch.tables.get(table_id, f"#{table_id}")


def _make_block(
    batch: Batch, table_id: int, positions: Int64Array, rows: int, size: int, replay: bool
) -> Block:
    name = _table_name(batch, table_id)
    first = int(batch.offsets[positions[0]])
    last = int(batch.offsets[positions[-1]])
    return Block(
        topic=batch.topic,
        partition=batch.partition,
        table_id=table_id,
        table=name,
        first=first,
        last=last,
        positions=positions,
        rows=rows,
        size=size,
        token=block_token(batch.topic, batch.partition, name, first, last,
                          batch.pins.incarnation),
        replay=replay,
    )


def _sort_key_dtype(table_ids: Int64Array) -> type[np.uint8] | type[np.uint16] | None:
    """A narrow dtype for the table ids, so numpy's stable sort uses radix sort."""
    if table_ids.size == 0 or int(table_ids.min()) < 0:
        return None
    top = int(table_ids.max())
    if top < 2**8:
        return np.uint8
    if top < 2**16:
        return np.uint16
    return None


def _segments(
    keys: npt.NDArray[np.integer[Any]], table_ids: Int64Array, order: Int64Array, small: bool
) -> list[tuple[int, int, int]]:
    """``(table_id, a, b)``: the table's messages are ``order[a:b]``, in offset order."""
    if small:
        counts = np.bincount(keys)
        present = np.flatnonzero(counts)
        ends = np.cumsum(counts[present])
        return [
            (int(t), int(e - c), int(e))
            for t, c, e in zip(present, counts[present], ends, strict=True)
        ]
    sorted_tables = table_ids[order]
    starts = np.flatnonzero(sorted_tables[1:] != sorted_tables[:-1]) + 1
    bounds = [0, *starts.tolist(), int(order.shape[0])] if order.shape[0] else [0]
    return [(int(sorted_tables[a]), a, b) for a, b in pairwise(bounds)]


def form_blocks(
    batch: Batch,
    resume: int,
    replay: Mapping[int, BlockRange],
    thresholds: Thresholds,
) -> Formation:
    """Form the batch's blocks column-wise; same result as :func:`form_blocks_per_message`.

    ``resume`` is the resume offset and ``replay`` maps table id to the block to
    rebuild. Raises :class:`ReplayBlockMissing` when a replay block's first or last
    message is not in the batch.
    """
    offsets = batch.offsets
    n = len(batch)
    lo = int(np.searchsorted(offsets, resume, side="left"))
    table_ids = batch.table_ids[lo:]
    narrow = _sort_key_dtype(table_ids)
    keys: npt.NDArray[np.integer[Any]] = (
        table_ids.astype(narrow) if narrow is not None else table_ids
    )
    order: Int64Array = np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    order += lo
    cum_rows = np.cumsum(batch.row_counts[order])
    cum_bytes = np.cumsum(batch.sizes[order])
    segments = _segments(keys, batch.table_ids, order, narrow is not None)

    found: list[tuple[int, int, Block]] = []
    delivered = lo
    replay_seen: set[int] = set()
    max_rows = thresholds.max_rows
    max_bytes = thresholds.max_bytes
    for table_id, a, b in segments:
        i = a
        block_range = replay.get(table_id)
        if block_range is not None:
            replay_seen.add(table_id)
            segment = offsets[order[a:b]]
            i_first = a + int(np.searchsorted(segment, block_range.first, side="left"))
            i_end = a + int(np.searchsorted(segment, block_range.last, side="right"))
            if (
                i_first >= i_end
                or int(segment[i_first - a]) != block_range.first
                or int(segment[i_end - 1 - a]) != block_range.last
            ):
                raise _missing(batch, block_range, _table_name(batch, table_id))
            delivered += i_first - a
            base_rows = int(cum_rows[i_first - 1]) if i_first else 0
            base_bytes = int(cum_bytes[i_first - 1]) if i_first else 0
            block = _make_block(
                batch,
                table_id,
                order[i_first:i_end],
                int(cum_rows[i_end - 1]) - base_rows,
                int(cum_bytes[i_end - 1]) - base_bytes,
                replay=True,
            )
            found.append((REPLAY_EVENT, block.first, block))
            i = i_end
        while i < b:
            base_rows = int(cum_rows[i - 1]) if i else 0
            base_bytes = int(cum_bytes[i - 1]) if i else 0
            j = min(
                int(np.searchsorted(cum_rows, base_rows + max_rows, side="left")),
                int(np.searchsorted(cum_bytes, base_bytes + max_bytes, side="left")),
            )
            if j >= b:
                j = b - 1
                sealed_at = n
            else:
                sealed_at = int(order[j])
            block = _make_block(
                batch,
                table_id,
                order[i : j + 1],
                int(cum_rows[j]) - base_rows,
                int(cum_bytes[j]) - base_bytes,
                replay=False,
            )
            found.append((sealed_at, block.first, block))
            i = j + 1
    for table_id, block_range in replay.items():
        if table_id not in replay_seen:
            raise _missing(batch, block_range, _table_name(batch, table_id))
    found.sort(key=lambda item: (item[0], item[1]))
    return Formation(
        blocks=tuple(item[2] for item in found),
        sealed_at=tuple(item[0] for item in found),
        delivered=delivered,
    )


def form_blocks_per_message(
    batch: Batch,
    resume: int,
    replay: Mapping[int, BlockRange],
    thresholds: Thresholds,
) -> Formation:
    """The plain per-message reference for :func:`form_blocks` (same arguments, same
    result): one Python step per message, the way the seed describes the aggregator."""
    offsets = batch.offsets.tolist()
    table_ids = batch.table_ids.tolist()
    row_counts = batch.row_counts.tolist()
    sizes = batch.sizes.tolist()
    n = len(offsets)
    max_rows = thresholds.max_rows
    max_bytes = thresholds.max_bytes
    buffers: dict[int, list[int]] = {}
    buffered_rows: dict[int, int] = {}
    buffered_bytes: dict[int, int] = {}
    replaying: dict[int, list[int]] = {}
    found: list[tuple[int, int, Block]] = []
    delivered = 0

    def seal(table_id: int, positions: list[int], rows: int, size: int, at: int) -> None:
        block = _make_block(
            batch, table_id, np.array(positions, dtype=np.int64), rows, size, at == REPLAY_EVENT
        )
        found.append((at, block.first, block))

    for i in range(n):
        offset = offsets[i]
        if offset < resume:
            delivered += 1
            continue
        table_id = table_ids[i]
        block_range = replay.get(table_id)
        if block_range is not None and offset <= block_range.last:
            if offset < block_range.first:
                delivered += 1
            else:
                replaying.setdefault(table_id, []).append(i)
            continue
        buffer = buffers.get(table_id)
        if buffer is None:
            buffer = buffers[table_id] = []
            buffered_rows[table_id] = 0
            buffered_bytes[table_id] = 0
        buffer.append(i)
        rows = buffered_rows[table_id] + row_counts[i]
        size = buffered_bytes[table_id] + sizes[i]
        if rows >= max_rows or size >= max_bytes:
            seal(table_id, buffer, rows, size, i)
            del buffers[table_id]
        else:
            buffered_rows[table_id] = rows
            buffered_bytes[table_id] = size
    for table_id, buffer in buffers.items():
        seal(table_id, buffer, buffered_rows[table_id], buffered_bytes[table_id], n)
    for table_id, block_range in replay.items():
        positions = replaying.get(table_id, [])
        if (
            not positions
            or offsets[positions[0]] != block_range.first
            or offsets[positions[-1]] != block_range.last
        ):
            raise _missing(batch, block_range, _table_name(batch, table_id))
        seal(
            table_id,
            positions,
            sum(row_counts[p] for p in positions),
            sum(sizes[p] for p in positions),
            REPLAY_EVENT,
        )
    found.sort(key=lambda item: (item[0], item[1]))
    return Formation(
        blocks=tuple(item[2] for item in found),
        sealed_at=tuple(item[0] for item in found),
        delivered=delivered,
    )
