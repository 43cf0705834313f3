"""A block's insert, built from the batch: its columns in the table's order, rows in
position order, as numpy/Native columns or Python lists (the writer's columnar path,
:mod:`aggregator.clickhouse.writer`).

Invariant 3: every function here is pure; the same block over the same batch always
gives the same data, so a retry sends the very same rows. Split from the writer
(issue 29).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from blockagg.aggregator.clickhouse.exceptions import ClickHouseError
from blockagg.aggregator.clickhouse.native import NativeBlock, concat, native_type_ok
from blockagg.aggregator.clickhouse.structure import DEAD_LETTER_COORDINATES
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from blockagg.aggregator.core.model import Batch, Block
from blockagg.rows.columns import (
    COORDINATE_COLUMNS,
    INCARNATION_COLUMN,
    ColumnSet,
    Payloads,
    Rows,
    TablePlan,
)
from blockagg.rows.deadletters import COLUMNS as DEAD_LETTER_COLUMNS
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.layout import NATIVE_COLUMNS, StringColumn
from blockagg.rows.types import INT_RANGES, CHType, default_value, parse_type

log = logging.getLogger(__name__)

NUMPY_TYPES: Final = frozenset({*INT_RANGES, "Float32", "Float64", "String", "DateTime",
                                "Enum8", "Enum16", "Array"})
"""Column types a block may have to go through clickhouse-driver's numpy mode:
written from arrays (integers, floats, String, DateTime without a time zone), or
by the driver's generic column from an ``object`` array (Enum8/16, Array(T))."""

DEFAULT_INSERT_BLOCK_SIZE: Final = 1_048_576
"""clickhouse-driver's ``insert_block_size``: larger blocks go as lists, which the
driver splits at exactly this many rows (its numpy mode splits differently)."""

BUILT_AHEAD_BYTES: Final = 64 << 20
"""How many bytes of messages :class:`BlocksBuiltAhead` builds ahead per seal event: all
of a batch of small blocks; the rest are built in their lanes, as before, so the memory
held twice (the batch's columns and the blocks' Native bytes) stays bounded."""

BUILT_AHEAD_BLOCK_BYTES: Final = 256 << 10
"""The largest block (bytes of messages) built ahead. Building ahead pays where the
per-block part of an insert's CPU dominates: 1.20x less CPU at 400 blocks of 1,230 rows
(~100 KiB), none measured at 133 blocks of 3,739 rows or 40 of 12,480
(docs/BENCHMARKS.md, *Blocks built ahead*), where building in the lanes overlaps the
other lanes' waits instead of holding every lane back until all are built."""

_NUMPY_FALLBACK_WARNING: Final = "NumPy support is not implemented for"


class _QuietNumpyFallback(logging.Filter):
    """Drops clickhouse-driver's per-insert warning that an Enum/Array column takes
    the generic path in numpy mode: that is by design here (:data:`NUMPY_TYPES`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NUMPY_FALLBACK_WARNING)


@functools.cache
def numpy_inserts_available() -> bool:
    """Whether clickhouse-driver's numpy mode can be used (it needs pandas)."""
    try:
        import clickhouse_driver.columns.numpy.service
        import clickhouse_driver.numpy.helpers  # noqa: F401
    except ImportError:
        return False
    logging.getLogger("clickhouse_driver.columns.service").addFilter(_QuietNumpyFallback())
    return True


def numpy_type_ok(ch: CHType) -> bool:
    """Whether a column of type ``ch`` may go through the numpy mode."""
    if ch.name == "DateTime":
        return not ch.args
    return ch.name in NUMPY_TYPES


@dataclass(frozen=True, eq=False)
class BlockData:
    """A block's insert: column names, columns, and whether they are columnar
    (numpy arrays and :mod:`~aggregator.clickhouse.native` columns, with their
    ``types``) or Python lists."""

    names: tuple[str, ...]
    columns: list[Any]
    numpy: bool
    types: tuple[CHType, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.columns[0]) if self.columns else 0

    def fresh(self, lists: bool = False, native: bool = False) -> Any:
        """The columns for one attempt: ``native``, the block in Native layout for
        :class:`~aggregator.clickhouse.native.NativeClient` (immutable, encoded once);
        ``lists``, Python lists (the same values) for a client without numpy mode;
        otherwise a copy for clickhouse-driver's numpy mode (which rewrites some in
        place)."""
        if native:
            block = self.native_block()
            if block is not None:
                return block
        if lists:
            return [c.tolist() if hasattr(c, "tolist") else list(c) for c in self.columns]
        return [c.copy() if isinstance(c, np.ndarray) else c.driver_items()
                if isinstance(c, NATIVE_COLUMNS) else list(c) for c in self.columns]

    def native_block(self) -> NativeBlock | None:
        """The block in Native layout (made once), or ``None`` when a column is not
        columnar or has a type :func:`~aggregator.clickhouse.native.encode_column`
        does not write."""
        if self._native is None:
            if not (self.numpy and all(native_type_ok(t) for t in self.types)):
                return None
            object.__setattr__(self, "_native",
                               NativeBlock(self.names, self.types, self.columns))
        return self._native

    _native: NativeBlock | None = field(default=None, init=False, repr=False)


class BlocksBuiltAhead:
    """One seal event's inserts built ahead, on the executor's thread, for the lanes to
    take (:meth:`aggregator.clickhouse.writer.ClickHouseBlockWriter.build_ahead`).

    Why: a lane builds its block right after waking from the previous insert's answer,
    when the servers have just used the shared cores' caches; built one after another
    beforehand, the same work costs less CPU (docs/BENCHMARKS.md, *Blocks built
    ahead*). What a lane takes is what it would have built, since a block's insert is a
    pure function of the block and the batch (invariant 3). Holds one event at a time
    (the writer serves one task at a time): :meth:`fill` drops what the last event
    left, e.g. when an insert failed before the rest were taken."""

    def __init__(self, budget: int = BUILT_AHEAD_BYTES) -> None:
        self.budget = budget
        self._slot: tuple[Batch | None, dict[str, BlockData]] = (None, {})

    def fill(self, blocks: Sequence[Block], batch: Batch,
             build: Callable[[Block], BlockData]) -> int:
        """Build ``blocks`` in order with ``build`` (and their Native bytes), those of
        at most :data:`BUILT_AHEAD_BLOCK_BYTES`, until :attr:`budget` bytes of
        messages; returns how many were built. The first that
        fails to build ends the filling: its insert builds it again and raises, in the
        lanes' order, as without this."""
        built: dict[str, BlockData] = {}
        self._slot = (batch, built)
        budget = self.budget
        for block in blocks:
            if block.size > BUILT_AHEAD_BLOCK_BYTES:
                continue
            if block.size > budget:
                break
            try:
                data = build(block)
                native = data.native_block()
                if native is not None:
                    native.encoded  # noqa: B018  (computed now, kept on the block)
            except Exception:
                log.debug("block %s not built ahead", block.token, exc_info=True)
                break
            budget -= block.size
            built[block.token] = data
        if not built:
            self._slot = (None, {})
        return len(built)

    def take(self, block: Block, batch: Batch) -> BlockData | None:
        """``block``'s insert if :meth:`fill` built it for this very batch (once). The
        last one taken lets go of the batch, so its columns are not kept past its
        inserts."""
        filled, built = self._slot
        if filled is not batch:
            return None
        data = built.pop(block.token, None)
        if not built:
            self._slot = (None, {})
        return data


def block_data(block: Block, batch: Batch, numpy: bool, dead_letter_incarnation: bool = False,
               insert_block_size: int = DEFAULT_INSERT_BLOCK_SIZE) -> BlockData:
    """The block's insert, rows in position order: numpy arrays when ``numpy``
    and every column
    converted to an array of a :data:`NUMPY_TYPES` type, else Python lists.
    ``dead_letter_incarnation``: the dead-letter table has the ``incarnation``
    column (``ClickHouseBlockWriter._dead_letter_incarnation``), which a dead-letter
    block then fills.

    Pure: the same block over the same batch always gives the same data."""
    bulk = (batch.payloads.runs(block.positions)
            if isinstance(batch.payloads, Payloads)
            and block.table_id != DEAD_LETTER_TABLE_ID else None)
    if bulk is not None:
        # The block's rows as slices of the batch's columns: no object per message.
        runs, counts = bulk
        names, fills = union_columns(block, [cs.plan for cs, _, _ in runs])
        if (numpy and not fills
                and numpy_eligible(block, insert_block_size, int(counts.sum()),
                                   [cs for cs, _, _ in runs])):
            return BlockData(names, array_columns(block, batch, runs, counts), True,
                             runs[0][0].plan.types)
    payloads = [batch.payloads[int(p)] for p in block.positions]
    if block.table_id == DEAD_LETTER_TABLE_ID:
        rows = []
        for payload in payloads:
            if not isinstance(payload, DeadLetter):
                raise ClickHouseError(
                    f"block of the dead-letter table holds a {type(payload).__name__} "
                    "payload; the task must pass a DeadLetter (make_dead_letter)")
            rows.append(payload.row())
        columns = [list(col) for col in zip(*rows, strict=True)]
        if dead_letter_incarnation:
            return BlockData((*DEAD_LETTER_COLUMNS, DEAD_LETTER_COORDINATES.incarnation),
                             [*columns, [batch.pins.incarnation] * len(rows)], False)
        return BlockData(DEAD_LETTER_COLUMNS, columns, False)
    rows_payloads: list[Rows] = []
    for payload in payloads:
        if not isinstance(payload, Rows):
            raise ClickHouseError(
                f"block of {block.table} holds a {type(payload).__name__} payload; "
                "expected blockagg.rows.columns.Rows")
        rows_payloads.append(payload)
    names, fills = union_columns(block, [p.columns.plan for p in rows_payloads])
    if numpy and not fills and numpy_eligible(
            block, insert_block_size, sum(p.count for p in rows_payloads),
            [p.columns for p in rows_payloads]):
        counts = np.fromiter((p.count for p in rows_payloads), dtype=np.int64,
                             count=len(rows_payloads))
        return BlockData(names, array_columns(block, batch, _runs(rows_payloads),
                                                    counts), True,
                         rows_payloads[0].columns.plan.types)
    values: list[list[Any]] = []
    positions = block.positions.tolist()
    for name in names:
        col: list[Any] = []
        for payload, pos in zip(rows_payloads, positions, strict=True):
            plan = payload.columns.plan
            j = plan.columns.index(name) if name in plan.columns else -1
            if j < 0:
                col.extend([fills[name]] * payload.count)
            elif plan.fields[j] is None and name == INCARNATION_COLUMN:
                col.extend([batch.pins.incarnation] * payload.count)
            elif plan.fields[j] is None and name in COORDINATE_COLUMNS:
                value = (block.topic if name == "_topic" else block.partition
                         if name == "_partition" else int(batch.offsets[pos]))
                col.extend([value] * payload.count)
            else:
                part = payload.columns.values[j][payload.start:payload.stop]
                col.extend(part.tolist() if hasattr(part, "tolist") else part)
        values.append(col)
    return BlockData(names, values, False)


def numpy_eligible(block: Block, limit: int, rows: int, sets: Sequence[ColumnSet]) -> bool:
    """Every column (of the block's column ``sets``, ``rows`` rows in all) an array
    of a numpy-mode type, and the block within one driver insert block (a
    function of the block only: a retry agrees); ``limit``: the driver's
    ``insert_block_size``. Pure."""
    if block.rows > limit or rows > limit:
        return False
    for cs in dict.fromkeys(sets):
        for ch, fd, values in zip(cs.plan.types, cs.plan.fields, cs.values, strict=True):
            if not numpy_type_ok(ch):
                return False
            if fd is not None and not isinstance(values, _ARRAY_KINDS):
                return False
    return True


_ARRAY_KINDS: Final = (np.ndarray, *NATIVE_COLUMNS)


def array_columns(block: Block, batch: Batch, runs: Sequence[tuple[ColumnSet, int, int]],
                   counts: npt.NDArray[np.int64]) -> list[Any]:
    """The block's columns from its ``runs`` of rows (:func:`_runs`) and each
    message's row count (``counts``, for the ``_offset`` column)."""
    plan = runs[0][0].plan
    n = int(counts.sum())
    out: list[Any] = []
    for j, name in enumerate(plan.columns):
        col: Any
        if plan.fields[j] is None and name == INCARNATION_COLUMN:
            col = np.full(n, batch.pins.incarnation, dtype=np.uint64)
        elif plan.fields[j] is None and name in COORDINATE_COLUMNS:
            if name == "_topic":
                col = StringColumn.repeat(block.topic, n)
            elif name == "_partition":
                col = np.full(n, block.partition, dtype=np.int64)
            else:
                col = np.repeat(batch.offsets[block.positions].astype(np.int64), counts)
        else:
            parts = []
            for cs, start, stop in runs:
                values = cs.values[j]
                assert isinstance(values, (np.ndarray, *NATIVE_COLUMNS))
                parts.append(values[start:stop])
            col = concat(parts)
        out.append(col)
    return out

def union_columns(block: Block, plans: Sequence[TablePlan]
                   ) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The insert's columns for a block whose messages were decoded with
    ``plans``: the union of the plans' columns in the table's column order, and
    the value each column takes in rows of a version that lacks it (its
    constant DEFAULT, NULL, or the type's zero value). A column no version of
    the block carries is left out, so the server computes its DEFAULT."""
    distinct: list[TablePlan] = []
    for plan in plans:
        if all(plan is not d and plan.columns != d.columns for d in distinct):
            distinct.append(plan)
    first = distinct[0]
    if len(distinct) == 1:
        return first.columns, {}
    # The newest version's recorded columns line the others up: they hold every
    # column an older version feeds (a pure function of the registry history).
    live = max((p for p in distinct if p.live), key=lambda p: p.version,
               default=first).live
    if not live:
        raise ClickHouseError(
            f"block of {block.table} mixes schema versions with different columns and "
            "its plans carry no live columns; build plans with "
            "blockagg.rows.columns.make_plan")
    present = {name for p in distinct for name in p.columns}
    names = tuple(c.name for c in live if c.name in present)
    fills: dict[str, Any] = {}
    for c in live:
        if c.name not in present or all(c.name in p.columns for p in distinct):
            continue
        value, exact = default_value(parse_type(c.type), c.default_kind,
                                     c.default_expression)
        if not exact:
            log.warning("%s: rows of schema versions without column %s get %r, not its "
                        "DEFAULT %s (not a constant); pin one version per block or make "
                        "the default a literal", block.table, c.name, value,
                        c.default_expression)
        fills[c.name] = value
    return names, fills


def _runs(payloads: Sequence[Rows]) -> list[tuple[ColumnSet, int, int]]:
    """The payloads' rows as runs ``(columns, start, stop)``: consecutive payloads that
    are adjacent slices of one ColumnSet (the usual case: one decode per table and
    partition) are taken as one slice (as :meth:`rows.Payloads.runs` does)."""
    runs: list[tuple[ColumnSet, int, int]] = []
    for p in payloads:
        if runs and runs[-1][0] is p.columns and runs[-1][2] == p.start:
            runs[-1] = (p.columns, runs[-1][1], p.stop)
        else:
            runs.append((p.columns, p.start, p.stop))
    return runs
