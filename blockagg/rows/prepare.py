"""Task-side preparation of one partition's messages for the core: envelope parsing,
registry lookup, vectorised decoding per (table, version), and dead letters.

:func:`prepare` returns the per-message arrays a :class:`aggregator.core.model.Batch`
needs. Every decision is a pure function of the messages and the registry as of the
batch's pinned position (``Pins.registry``): table or dead letter, schema version,
and the insert plan, made from the columns the version was registered with
(``SchemaVersion.columns``). The live table is only *checked* against that plan
(:class:`~aggregator.clickhouse.exceptions.ColumnsChanged`, a refusal), never used to
change it, so a replayed micro-batch prepares identically. Versions registered
without columns (``--no-check``, or before columns were recorded) take the live
columns, re-read every ``columns_ttl_s``: not pinned (``docs/protocol.md``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from blockagg.exceptions import BlockaggError
from blockagg.proto.envelope import (
    LATEST,
    Envelopes,
    Parsed,
    Rejected,
    parse_envelope,
    parse_envelopes,
)
from blockagg.proto.exceptions import ProtoError
from blockagg.proto.registry import Registration, Registry, SchemaVersion
from blockagg.rows.columns import (
    WRITER_COLUMNS,
    Column,
    ColumnSet,
    Payloads,
    Rows,
    TablePlan,
    decide_envelopes_many,
    decode_messages,
    make_plan,
    with_incarnation,
)
from blockagg.rows.deadletters import DEFAULT_TABLE, DeadLetter, make_dead_letter
from blockagg.rows.exceptions import ColumnsChanged

log = logging.getLogger(__name__)


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
    payloads: Sequence[Rows | DeadLetter] | Payloads
    """A list (:func:`prepare`), or :class:`Payloads` (:func:`prepare_envelopes`),
    whose items are the same."""
    tables: dict[int, str]

    @property
    def dead_letters(self) -> int:
        return int(np.count_nonzero(self.table_ids == DEAD_LETTER_TABLE_ID))


def column_changes(plan: TablePlan, live: Sequence[Column]) -> list[str]:
    """What the live table lost of the columns ``plan`` (made from a version's
    recorded columns) inserts: a column gone, another type, or one turned
    ``MATERIALIZED``/``ALIAS``. Empty: the plan inserts as when it was registered."""
    by_name = {c.name: c for c in live}
    recorded = {c.name: c for c in plan.live}
    problems = []
    for name in plan.columns:
        want = recorded[name]
        have = by_name.get(name)
        if have is None:
            problems.append(f"column {name} {want.type} is gone")
        elif have.type != want.type:
            problems.append(f"column {name} is {have.type}, registered as {want.type}")
        elif have.default_kind in ("MATERIALIZED", "ALIAS"):
            problems.append(f"column {name} became {have.default_kind}")
    return problems


def needs_newer(registry: Registry, table: str, version: int, timestamp_ms: int) -> bool:
    """Whether ``registry`` may be too old to decide a message of ``table`` with
    ``schema_version = version`` stamped ``timestamp_ms``: the table or version is
    unknown, or version 0 is stamped after the snapshot was last known current."""
    if table not in registry:
        return True
    if version == LATEST:
        return not registry.covers(timestamp_ms)
    return all(v.version != version for v in registry.get(table).versions)


class Plans:
    """Insert plans per (table, version), built lazily from the registry.

    ``registry`` is the view decisions are made with; the task sets it to the
    registry as of the batch's pinned position before each :func:`prepare`. A
    version's plan is made from the columns it was registered with, and checked
    against ``columns(table)`` (the live columns, re-read once they are older than
    ``columns_ttl_s``, see :meth:`expire_live`). ``reload`` (tests, tools) returns a
    fresh snapshot: :func:`prepare` calls it, at most once per call, when a message
    names a table or version the snapshot lacks, or carries ``schema_version = 0``
    with a timestamp the snapshot does not cover (:func:`needs_newer`). Without it the
    registry is used as is (the job's pinned path).
    """

    def __init__(self, registry: Registry, columns: Callable[[str], Sequence[Column]],
                 reload: Callable[[], Registry] | None = None, *,
                 columns_ttl_s: float = float("inf"),
                 clock: Callable[[], float] = time.monotonic,
                 columns_many: Callable[[Sequence[str]], Mapping[str, Sequence[Column]]]
                 | None = None) -> None:
        self.registry = registry
        self._columns = columns
        self._columns_many = columns_many
        self._previous: dict[str, tuple[Column, ...]] = {}
        self._reload = reload
        self._ttl = columns_ttl_s
        self._clock = clock
        self._live: dict[str, tuple[float, tuple[Column, ...]]] = {}
        self._plans: dict[tuple[str, int], tuple[TablePlan, list[str]]] = {}
        self._from_live: dict[tuple[str, int], tuple[tuple[Column, ...], TablePlan, list[str]]] = {}
        self._checked: dict[tuple[str, int], tuple[Column, ...]] = {}
        self._incarnated: dict[tuple[str, int], tuple[tuple[Column, ...],
                                                      tuple[TablePlan, list[str]]]] = {}

    @property
    def reloads(self) -> bool:
        """Whether :func:`prepare` may re-read the registry (a ``reload`` was given)."""
        return self._reload is not None

    def refresh(self) -> bool:
        """Re-read the registry (when a ``reload`` was given); plans already built
        stay valid, since a registered version never changes."""
        if self._reload is None:
            return False
        self.registry = self._reload()
        return True

    def expire_live(self) -> None:
        """Forget live columns read ``columns_ttl_s`` ago or more (``[schemas]
        refresh_interval``): an ALTER TABLE reaches long-lived workers. Called between
        batches, so one batch sees one set of live columns."""
        now = self._clock()
        for table in [t for t, (read, _) in self._live.items() if now - read >= self._ttl]:
            self._previous[table] = self._live.pop(table)[1]

    def prefetch(self, tables: Iterable[str]) -> None:
        """Read the live columns of those of ``tables`` not cached, with one
        ``columns_many`` call (when given) instead of one ``columns`` call each: the
        same columns and checks, a few queries a batch instead of several a table.
        A failure caches nothing and is not raised: :meth:`live` reads such a table
        alone and raises for it, as without a prefetch, so a table the batch does not
        end up inserting into cannot fail the batch."""
        missing = [t for t in dict.fromkeys(tables) if t not in self._live]
        if self._columns_many is None or not missing:
            return
        try:
            read = self._columns_many(missing)
        except BlockaggError:
            log.debug("prefetch of %d tables' live columns failed; reading them one by one",
                      len(missing), exc_info=True)
            return
        now = self._clock()
        for table in missing:
            if table in read:
                self._live[table] = (now, self._same(table, tuple(read[table])))

    def _same(self, table: str, columns: tuple[Column, ...]) -> tuple[Column, ...]:
        """``columns``, or the equal tuple read before: the plans, checks and
        incarnation plans cached by identity of the live columns stay valid when a
        re-read finds the table unchanged (they are pure functions of its columns), and
        are rebuilt when an ALTER changed them."""
        previous = self._previous.pop(table, None)
        return previous if previous == columns else columns

    def live(self, table: str) -> tuple[Column, ...]:
        """The table's live columns (cached, see :meth:`expire_live`); raises
        :class:`~aggregator.clickhouse.exceptions.TableNotFound`."""
        entry = self._live.get(table)
        if entry is None:
            entry = self._live[table] = (self._clock(),
                                         self._same(table, tuple(self._columns(table))))
        return entry[1]

    def needs_refresh(self, table: str, version: int, timestamp_ms: int) -> bool:
        """Whether the snapshot may be too old to decide this message."""
        return needs_newer(self.registry, table, version, timestamp_ms)

    def plan(self, table: str, version: int, timestamp_ms: int | None = None
             ) -> tuple[TablePlan, list[str]]:
        """The plan for a message of ``table`` with ``schema_version = version``.

        With ``timestamp_ms`` (the message's Kafka timestamp), version 0 resolves
        deterministically (:meth:`proto.registry.Registration.resolve`); without it,
        to the view's latest. Raises :class:`proto.exceptions.UnknownTable`/
        ``UnknownVersion`` (dead letters), and, refusing the batch,
        :class:`~aggregator.clickhouse.exceptions.TableNotFound` when the live table
        is gone or :class:`~aggregator.clickhouse.exceptions.ColumnsChanged` when it
        no longer has what the version's plan writes."""
        reg = self.registry.get(table)
        resolved = (reg.version(version) if timestamp_ms is None
                    else reg.resolve(version, timestamp_ms))
        key = (table, resolved.version)
        if not resolved.columns:
            return self._plan_from_live(key, reg.table_id, resolved)
        if key not in self._plans:
            recorded = [Column(*c) for c in resolved.columns]
            self._plans[key] = make_plan(table, reg.table_id, resolved.version,
                                         resolved.descriptor, recorded)
        found = self._plans[key]
        self._check_live(found[0])
        live = self.live(table)
        augmented = self._incarnated.get(key)
        if augmented is None or augmented[0] is not live:
            augmented = self._incarnated[key] = (
                live, (with_incarnation(found[0], live), found[1]))
        return augmented[1]

    def _plan_from_live(self, key: tuple[str, int], table_id: int,
                        resolved: SchemaVersion) -> tuple[TablePlan, list[str]]:
        live = self.live(key[0])
        cached = self._from_live.get(key)
        if cached is None or cached[0] is not live:
            plan, problems = make_plan(key[0], table_id, resolved.version,
                                       resolved.descriptor, live)
            cached = self._from_live[key] = (live, plan, problems)
        return cached[1], cached[2]

    def _check_live(self, plan: TablePlan) -> None:
        live = self.live(plan.table)
        key = (plan.table, plan.version)
        if self._checked.get(key) is live:
            return
        problems = column_changes(plan, live)
        if problems and self._live.get(plan.table, (None, None))[1] is live:
            # The copy may predate an ALTER that a version registered since relies on:
            # read the table once more before refusing. Only the check depends on it;
            # a recorded plan's columns come from the registry.
            del self._live[plan.table]
            live = self.live(plan.table)
            problems = column_changes(plan, live)
        if problems:
            coordinates = [n for n in plan.columns if n in WRITER_COLUMNS]
            raise ColumnsChanged(
                f"{plan.table}: schema version {plan.version} was registered against "
                f"columns the live table no longer has ({'; '.join(problems)}); its rows "
                "would be inserted differently than a replay of them, so the batch is "
                "refused (nothing was committed or inserted). Restore the column(s) on "
                "every replica, or register a new version against the current columns and "
                "move the producers to it (in-flight messages of this version still need "
                "the old columns)" + (f"; coordinate columns {coordinates} are written "
                                      "too" if coordinates else ""))
        self._checked[key] = live


def prepare(topic: str, partition: int, messages: Sequence[Message], plans: Plans,
            dead_letter_table: str = DEFAULT_TABLE, columnar: bool = True,
            parsed: Sequence[Parsed | Rejected] | None = None) -> Prepared:
    """Classify and decode ``messages`` (in offset order). ``columnar`` (default)
    converts to numpy columns where it can (:func:`~blockagg.rows.columns.
    decode_messages`); False is the previous per-value path, same values.
    ``parsed``: the messages' envelopes, when the caller parsed them already.

    Every dead letter's ``error`` is a function of the message and the registry
    view: no host, no live column, no clock."""
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

    parsed_all = (list(parsed) if parsed is not None
                  else [parse_envelope(m.value) for m in messages])
    if plans.reloads and any(
            isinstance(p, Parsed) and plans.needs_refresh(p.table, p.version, m.timestamp_ms)
            for p, m in zip(parsed_all, messages, strict=True)):
        plans.refresh()
    for i, (m, envelope) in enumerate(zip(messages, parsed_all, strict=True)):
        if not isinstance(envelope, Parsed):
            dead(i, envelope.reason, envelope.table)
            continue
        try:
            plan, problems = plans.plan(envelope.table, envelope.version, m.timestamp_ms)
        except ProtoError as exc:
            dead(i, str(exc), envelope.table)
            continue
        if problems:
            dead(i, f"schema version {plan.version} does not match the table's columns: "
                    f"{'; '.join(problems)}", envelope.table)
            continue
        groups.setdefault((envelope.table, plan.version), []).append((i, envelope))
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


def _groups(keys: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
    """Positions of equal ``keys``, each group in position order, the groups in the
    order of their first position."""
    if not keys.size:
        return []
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    split = np.split(order, np.cumsum(np.bincount(inverse))[:-1])
    return [split[g] for g in np.argsort(first, kind="stable").tolist()]


def _by_table_version(envelopes: Envelopes, positions: npt.NDArray[np.int64],
                      versions: npt.NDArray[np.int64]
                      ) -> Iterator[tuple[npt.NDArray[np.int64], str, int]]:
    """The messages at ``positions`` (``versions``: each one's schema version) grouped
    by (table, version): each group's positions, table and version, in the order of
    their first message."""
    keys = envelopes.table_index[positions] * (1 << 33) + versions
    for group in _groups(keys):
        members = positions[group]
        yield (members, envelopes.tables[int(envelopes.table_index[members[0]])],
               int(versions[group[0]]))


def needs_newer_any(registry: Registry, envelopes: Envelopes,
                    timestamps_ms: npt.NDArray[np.int64]) -> bool:
    """Whether :func:`needs_newer` holds for any accepted message of ``envelopes``
    (Kafka timestamps ``timestamps_ms``): decided once per (table, version), with
    the group's latest timestamp for version 0 (:meth:`Registry.covers` holds for
    every earlier one when it holds for the latest)."""
    accepted = np.flatnonzero(envelopes.table_index >= 0)
    for members, table, version in _by_table_version(envelopes, accepted,
                                                     envelopes.versions[accepted]):
        if needs_newer(registry, table, version, int(timestamps_ms[members].max())):
            return True
    return False


def _latest_at(reg: Registration, timestamps_ms: npt.NDArray[np.int64]
               ) -> npt.NDArray[np.int64]:
    """:meth:`Registration.resolve` of ``schema_version = 0`` for each timestamp, as
    the version number (0: no version registered by then)."""
    at = np.array([v.registered_at_ms for v in reg.versions], dtype=np.int64)
    numbers = np.array([v.version for v in reg.versions], dtype=np.int64)
    order = np.argsort(at, kind="stable")
    best = np.maximum.accumulate(numbers[order])
    k = np.searchsorted(at[order], timestamps_ms, side="right") - 1
    return np.where(k >= 0, best[np.maximum(k, 0)], 0)


def prepare_envelopes(topic: str, partition: int,
                      offsets: Sequence[int] | npt.NDArray[np.int64],
                      timestamps_ms: Sequence[int] | npt.NDArray[np.int64],
                      values: Sequence[bytes | None],
                      plans: Plans, dead_letter_table: str = DEFAULT_TABLE,
                      columnar: bool = True, envelopes: Envelopes | None = None
                      ) -> Prepared:
    """:func:`prepare` of the messages given as columns (offset order), with their
    envelopes parsed in bulk (:func:`proto.envelope.parse_envelopes`, or
    ``envelopes`` when the caller has them) and the registry consulted once per
    (table, version) rather than per message: the same decisions, dead-letter
    reasons, payloads and tables, without a Python object per message: the payloads
    are :class:`~blockagg.rows.columns.Payloads` (each (table, version)'s
    columns and every message's range of rows in them; dead letters only are
    objects)."""
    n = len(values)
    env = envelopes if envelopes is not None else parse_envelopes(values)
    stamps = np.asarray(timestamps_ms, dtype=np.int64).reshape(n)
    offs = np.asarray(offsets, dtype=np.int64).reshape(n)
    table_ids = np.zeros(n, dtype=np.int64)
    row_counts = np.ones(n, dtype=np.int64)
    sizes = env.sizes
    dead_letters: dict[int, object] = {}
    column_sets: list[ColumnSet] = []
    sets = np.full(n, -1, dtype=np.int64)
    starts = np.zeros(n, dtype=np.int64)
    stops = np.zeros(n, dtype=np.int64)

    def dead(i: int, error: str, table: str = "") -> None:
        dead_letters[i] = make_dead_letter(topic, partition, int(offs[i]), int(stamps[i]),
                                           values[i], error, table)
        table_ids[i] = DEAD_LETTER_TABLE_ID
        row_counts[i] = 1

    if plans.reloads and needs_newer_any(plans.registry, env, stamps):
        plans.refresh()
    plans.prefetch(t for t in env.tables if t in plans.registry)
    for i, rejected in env.rejected.items():
        dead(i, rejected.reason, rejected.table)
    resolved = np.zeros(n, dtype=np.int64)  # the version each message decodes with

    def accept(members: npt.NDArray[np.int64], table: str, version: int) -> None:
        try:
            _, problems = plans.plan(table, version)
        except ProtoError as exc:  # unknown table or version: no timestamp in the text
            for i in members.tolist():
                dead(i, str(exc), table)
            return
        if problems:
            for i in members.tolist():
                dead(i, f"schema version {version} does not match the table's columns: "
                        f"{'; '.join(problems)}", table)
            return
        resolved[members] = version

    accepted = np.flatnonzero(env.table_index >= 0)
    for members, table, version in _by_table_version(env, accepted, env.versions[accepted]):
        if version != LATEST:
            accept(members, table, version)
            continue
        try:
            reg = plans.registry.get(table)
        except ProtoError as exc:
            for i in members.tolist():
                dead(i, str(exc), table)
            continue
        latest = _latest_at(reg, stamps[members])
        for i in members[latest == 0].tolist():
            try:  # no version yet at its timestamp: the reason names the timestamp
                plan, _ = plans.plan(table, LATEST, int(stamps[i]))
            except ProtoError as exc:
                dead(i, str(exc), table)
            else:
                accept(np.array([i]), table, plan.version)
        for number in np.unique(latest[latest > 0]).tolist():
            accept(members[latest == number], table, int(number))
    tables: dict[int, str] = {}
    decided = np.flatnonzero(resolved > 0)
    groups = [(members, table, plans.plan(table, version)[0])  # resolved versions: pinned
              for members, table, version in _by_table_version(env, decided,
                                                               resolved[decided])]
    outcomes = decide_envelopes_many([(plan, members) for members, _, plan in groups], env,
                                     columnar)
    for (members, table, plan), outcome in zip(groups, outcomes, strict=True):
        version = plan.version
        good = np.ones(members.size, dtype=np.bool_)
        for j, reason in outcome.reasons.items():
            good[j] = False
            dead(int(members[j]), f"{table} v{version}: {reason}", table)
        if not good.any():
            continue
        rows = members[good]
        sets[rows] = len(column_sets)
        column_sets.append(outcome.columns)
        starts[rows] = outcome.bounds[:-1][good]
        stops[rows] = outcome.bounds[1:][good]
        table_ids[rows] = plan.table_id
        row_counts[rows] = stops[rows] - starts[rows]
        tables[plan.table_id] = table
    if (table_ids == DEAD_LETTER_TABLE_ID).any():
        tables[DEAD_LETTER_TABLE_ID] = dead_letter_table
    payloads = Payloads(tuple(column_sets), sets, starts, stops, dead_letters)
    return Prepared(offs.copy(), table_ids, row_counts, sizes, payloads, tables)
