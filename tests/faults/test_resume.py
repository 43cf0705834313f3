"""Resuming a run: :meth:`Workload.restore` rebuilds, from the messages and the
registrations alone, exactly what the producer recorded while writing them (no stack)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from tests.faults.workload import (
    ROW_MESSAGE,
    V1,
    Workload,
    added_field,
    evolved_descriptor_set,
    row_descriptor_set,
)


class _Delivered:
    def __init__(self, topic: str, partition: int, offset: int, value: bytes) -> None:
        self._at = (topic, partition, offset)
        self._value = value

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]

    def value(self) -> bytes:
        return self._value


def _written(seed: int) -> tuple[Workload, MemoryStore, dict[int, list[bytes]]]:
    """A run written without Kafka: messages delivered round-robin into partitions,
    schema changes of the three kinds registered between them, as the fault does."""
    w = Workload("unused:1", "127.0.0.1", [1], tables=3, partitions=2, rows_per_message=3,
                 dead_every=7, seed=seed, run="resume1")
    store = MemoryStore()
    for name in w.table_names():
        register(store, name, ROW_MESSAGE, row_descriptor_set())
    partitions: dict[int, list[bytes]] = {0: [], 1: []}
    rng = random.Random(seed)

    def write(messages: int) -> None:
        for _ in range(messages):
            table, ids, value = w.message()
            p = w._counter % w.partitions
            w._delivery(table, ids)(None, _Delivered(w.topic, p, len(partitions[p]), value))
            partitions[p].append(value)

    write(40)
    for n in range(1, 6):
        w.schema_changes = n
        if n == 2:
            table = f"{w.database}.t{w.tables:03d}"
            register(store, table, ROW_MESSAGE, row_descriptor_set())
            w.tables += 1
            w.changed.add(table)
        else:
            table = rng.choice(w.table_names()[:3])
            old = w.schemas.get(table, V1)
            new = (replace(old, version=old.version + 1,
                           added=(*old.added, added_field(f"x{n}", 11 + len(old.added))))
                   if n % 2 else
                   replace(old, version=old.version + 1, package=f"blockagg.bench.v{n}"))
            register(store, table, f"{new.package}.Event", evolved_descriptor_set(new))
            w.schemas = {**w.schemas, table: new}
            w.changed.add(table)
        write(25)
    return w, store, partitions


def _ids(w: Workload) -> dict[str, list[int]]:
    return {t: sorted(w.produced.ids_of(t).tolist()) for t in w.table_names()}


def test_restore_rebuilds_what_the_producer_recorded() -> None:
    written, store, partitions = _written(seed=5)
    registrations = {r.table: r for r in Registry.from_records(store.read()).registrations()}
    chunks: list[tuple[str, int, int, list[bytes | None]]] = [
        (written.topic, p, at, list(values[at:at + 11]))
        for p, values in partitions.items() for at in range(0, len(values), 11)]

    resumed = Workload("unused:1", "127.0.0.1", [1], tables=3, partitions=2,
                       rows_per_message=3, dead_every=7, seed=5, run="resume1")
    resumed.restore(chunks, registrations)

    assert resumed.tables == written.tables == 4
    assert _ids(resumed) == _ids(written)
    assert resumed.produced.dead == written.produced.dead and written.produced.dead
    assert (resumed.produced.messages, resumed.produced.rows, resumed.produced.bytes) == (
        written.produced.messages, written.produced.rows, written.produced.bytes)
    assert resumed.changed == written.changed
    assert resumed.schemas == written.schemas
    assert resumed.switches == written.switches and written.switches
    for table in written.table_names():
        assert resumed.added_since(table) == written.added_since(table)
    assert resumed.schema_changes == written.schema_changes == 5
    assert resumed._next_id == written._next_id


def test_a_resumed_producer_continues_with_fresh_ids_and_the_latest_schema() -> None:
    _, store, partitions = _written(seed=9)
    registrations = {r.table: r for r in Registry.from_records(store.read()).registrations()}
    resumed = Workload("unused:1", "127.0.0.1", [1], tables=3, partitions=2,
                       rows_per_message=3, dead_every=7, seed=9, run="resume1")
    resumed.restore([(resumed.topic, p, 0, list(v)) for p, v in partitions.items()],
                    registrations)
    before: Any = np.concatenate([resumed.produced.ids_of(t) for t in resumed.table_names()])
    table, ids, _ = next(m for m in iter(resumed.message, None) if m[0] is not None)
    assert ids is not None and int(ids.min()) > int(before.max())
    assert table in resumed.table_names()


def test_a_run_resumed_after_a_topic_recreate_expects_what_the_old_topic_left(
        tmp_path: Path) -> None:
    """``topic_recreate``: what the job had stored of the old topic stays expected (its
    rows, its dead letters at coordinates the new topic reuses), the rest is the
    procedure's loss; a resume reads only the new topic, so the rest comes from
    ``save_retired``, and the rebuilt run expects exactly what the uninterrupted one does."""
    written, store, _ = _written(seed=7)
    stored = {(0, t): written.produced.ids_of(t)[::2] for t in written.table_names()}
    dead = Counter(sorted(written.produced.dead)[:-1])
    kept = written.retire_incarnation(stored, dead)
    assert kept["rows_kept"] and kept["rows_lost"] and kept["dead_kept"] and kept["dead_lost"]
    assert written.produced.kept_dead == dead and not written.produced.dead
    written.save_retired(tmp_path / "retired.npz")
    new: dict[int, list[bytes]] = {0: [], 1: []}
    for _ in range(2):  # never delivered: the new dead letters fall on old coordinates
        written.message()
    for _ in range(200):  # the new topic, offsets from 0 again
        table, ids, value = written.message()
        p = written._counter % written.partitions
        written._delivery(table, ids)(None, _Delivered(written.topic, p, len(new[p]), value))
        new[p].append(value)
    assert written.produced.dead & set(dead), "no dead letter at a reused coordinate"
    registrations = {r.table: r for r in Registry.from_records(store.read()).registrations()}

    resumed = Workload("unused:1", "127.0.0.1", [1], tables=3, partitions=2,
                       rows_per_message=3, dead_every=7, seed=7, run="resume1")
    resumed.restore([(resumed.topic, p, 0, list(v)) for p, v in new.items()], registrations,
                    tmp_path / "retired.npz")
    assert {t: sorted(v) for t, v in _ids(resumed).items()} == _ids(written)
    assert resumed.produced.dead == written.produced.dead
    assert resumed.produced.kept_dead == written.produced.kept_dead
    for table in written.table_names():
        assert resumed.added_since(table) == written.added_since(table)
    assert resumed._next_id == written._next_id and resumed.recreations == 1
