"""Insert lanes (``aggregator.lanes``): an event's inserts run at once, at most
``width`` of them, the call returns only when every started insert has ended, and
the first failure (in plan order) is raised; the fence's confirm is shared safely by
concurrent lanes; the executor still commits before and after each event."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.model import Batch, Block, Thresholds
from blockagg.aggregator.core.protocol import (
    CommitMetadata,
    InsertBlock,
    insert_order,
    plan_batch,
    run_batch,
    steps,
)
from blockagg.aggregator.kafka.exceptions import AttemptFenced
from blockagg.aggregator.lanes import SharedPermits, ThreadLanes
from blockagg.exceptions import ConfigError
from tests.unit.core.fakes import DedupSink, MemoryMetadataStore, make_batch
from tests.unit.core.test_fencing import Coordinator, store_and_opener

WAIT = 60.0
"""A safety net against a hang if a test's premise breaks; never reached when it holds."""


def test_inserts_run_at_once_up_to_the_width() -> None:
    lanes = ThreadLanes(3)
    together = threading.Barrier(3, timeout=WAIT)
    ran: list[int] = []

    def insert(i: int) -> Callable[[], None]:
        def run() -> None:
            together.wait()  # only returns once three inserts run at the same time
            ran.append(i)
        return run

    lanes.run([insert(i) for i in range(6)])
    assert sorted(ran) == list(range(6))
    lanes.close()


def test_never_more_than_width_at_a_time() -> None:
    lanes = ThreadLanes(2)
    lock = threading.Lock()
    running = [0, 0]  # now, most

    def insert() -> None:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        with lock:
            running[0] -= 1

    lanes.run([insert for _ in range(50)])
    assert running == [0, running[1]] and 1 <= running[1] <= 2
    lanes.close()


def test_a_failure_is_raised_after_the_inserts_in_flight_ended() -> None:
    lanes = ThreadLanes(2)
    slow_started, first_failed = threading.Event(), threading.Event()
    ended: list[str] = []

    def failing() -> None:
        assert slow_started.wait(WAIT)
        first_failed.set()
        raise RuntimeError("insert of block 0 failed")

    def slow() -> None:
        slow_started.set()
        assert first_failed.wait(WAIT)
        ended.append("slow")

    with pytest.raises(RuntimeError, match="block 0"):
        lanes.run([failing, slow])
    assert ended == ["slow"]  # run() waited for the insert in flight
    lanes.close()


def test_the_first_failure_in_plan_order_is_raised() -> None:
    lanes = ThreadLanes(2)
    second_failed = threading.Event()

    def first() -> None:
        assert second_failed.wait(WAIT)
        raise ValueError("first")

    def second() -> None:
        second_failed.set()
        raise KeyError("second")

    with pytest.raises(ValueError, match="first"):
        lanes.run([first, second])
    lanes.close()


def test_one_task_per_lane_not_per_insert() -> None:
    """An event of many inserts costs ``width`` hand-overs to the pool, not one per
    insert (a small block's CPU, docs/BENCHMARKS.md), and every insert still runs once,
    in order of taking."""
    lanes = ThreadLanes(3)
    submitted = 0
    submit = lanes._pool.submit

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal submitted
        submitted += 1
        return submit(*args, **kwargs)

    lanes._pool.submit = counted  # type: ignore[method-assign]
    ran: list[int] = []
    lock = threading.Lock()

    def insert(i: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                ran.append(i)
        return run

    lanes.run([insert(i) for i in range(50)])
    assert sorted(ran) == list(range(50))
    assert submitted == 3
    lanes.close()


def test_a_failure_stops_the_lanes_taking_more() -> None:
    """After a failure no lane takes another insert; the failure is raised."""
    lanes = ThreadLanes(2)
    ran: list[int] = []

    def insert(i: int) -> Callable[[], None]:
        def run() -> None:
            ran.append(i)
            if i == 0:
                raise ValueError("boom")
        return run

    with pytest.raises(ValueError, match="boom"):
        lanes.run([insert(i) for i in range(200)])
    assert len(ran) < 200
    lanes.close()


def test_width_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="insert concurrency must be >= 1, got 0"):
        ThreadLanes(0)


def test_steps_group_each_events_inserts_after_its_commit() -> None:
    messages = [(o, 1 + o % 3, 1) for o in range(12)]
    plan = plan_batch(make_batch(messages, 0, 12), None, Thresholds(3, 10**6), 1, 0)
    kinds = ["commit" if isinstance(s, CommitMetadata) else len(s) for s in steps(plan)]
    assert kinds == ["commit", 1, "commit", 1, "commit", 1, "commit", 3, "commit"]


class RecordingSink(DedupSink):
    """Blocks the inserts of the last event until all three run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.together = threading.Barrier(3, timeout=WAIT)
        self.lock = threading.Lock()

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.together.wait()
        with self.lock:
            super().insert(block, batch, confirmed_at)


def test_run_batch_with_lanes_commits_around_concurrent_inserts() -> None:
    coordinator = Coordinator()
    store, attempt = store_and_opener(coordinator)
    fenced = attempt("events", 0)
    reads: list[int] = []
    original = store.committed

    def counted(topic: str, partition: int) -> Any:
        reads.append(1)
        return original(topic, partition)

    store.committed = counted  # type: ignore[method-assign]
    messages = [(o, 1 + o % 3, 1) for o in range(6)]
    batch = make_batch(messages, 0, 6)
    plan = plan_batch(batch, None, Thresholds(100, 10**6), 1, 0)
    sink = RecordingSink()
    report = run_batch(plan, fenced, sink, fenced, ThreadLanes(3))
    assert report.blocks == 3 and report.rows == 6
    assert sorted(b.table for b in sink.inserted) == ["db.t1", "db.t2", "db.t3"]
    assert len(coordinator.history) == 2  # the intent, then the final commit
    assert 1 <= len(reads) <= 3  # each insert confirmed, by its own read or a shared one


def test_a_fenced_attempt_inserts_nothing_with_lanes() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    old = attempt("events", 0)
    messages = [(o, 1 + o % 3, 1) for o in range(6)]
    plan = plan_batch(make_batch(messages, 0, 6), None, Thresholds(100, 10**6), 1, 0)
    sink = DedupSink()

    class Overtaken(MemoryMetadataStore):
        """The intent goes through, then a newer attempt commits."""

        def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
            old.commit(topic, partition, offset, metadata)
            newer = attempt("events", 0)
            newer.commit(topic, partition, offset, metadata + "-newer")

    with pytest.raises(AttemptFenced, match="no longer this attempt's intent"):
        run_batch(plan, Overtaken(), sink, old, ThreadLanes(3))
    assert sink.inserted == []


def forced_flush(tables: int, partition: int) -> tuple[InsertBlock, ...]:
    """The one seal event of a catch-up batch: a block per table, tables interleaved
    in the same order in every partition (as one producer writes them)."""
    messages = [(o, 1 + o % tables, 1) for o in range(tables * 5)]
    batch = make_batch(messages, 0, len(messages), partition=partition)
    plan = plan_batch(batch, None, Thresholds(10**6, 10**9), 1, 0)
    groups = [s for s in steps(plan) if not isinstance(s, CommitMetadata)]
    assert len(groups) == 1
    return groups[0]


def test_partitions_side_by_side_start_their_lanes_on_different_tables() -> None:
    # 8 partitions of 100 tables on 4 lanes each: the first inserts every lane takes
    # are of distinct tables, so tasks running together do not meet on a table's
    # pending quorum (18.16 takes one quorum insert per table at a time).
    first = [[op.block.table for op in insert_order(forced_flush(100, p), p)[:4]]
             for p in range(8)]
    taken = [table for tables in first for table in tables]
    assert len(set(taken)) == len(taken) == 32
    assert [op.block.table for op in insert_order(forced_flush(100, 0), 0)] == [
        op.block.table for op in forced_flush(100, 0)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(0, 40), st.integers(0, 10_000))
def test_insert_order_is_a_rotation_of_the_plans(tables: int, partition: int) -> None:
    group = forced_flush(tables, 0) if tables else ()
    ordered = insert_order(group, partition)
    assert sorted(map(id, ordered)) == sorted(map(id, group))
    if group:
        start = group.index(ordered[0])
        assert ordered == [*group[start:], *group[:start]]


def test_run_batch_inserts_in_the_partitions_order() -> None:
    sink = DedupSink()
    messages = [(o, 1 + o % 10, 1) for o in range(50)]
    batch = make_batch(messages, 0, 50, partition=3)
    plan = plan_batch(batch, None, Thresholds(10**6, 10**9), 1, 0)
    run_batch(plan, MemoryMetadataStore(), sink)
    group = next(s for s in steps(plan) if not isinstance(s, CommitMetadata))
    assert [b.table for b in sink.inserted] == [
        op.block.table for op in insert_order(group, 3)]
    assert sink.inserted[0].table != group[0].block.table


def _in_flight(permits: SharedPermits, width: int, inserts: int,
               running: list[int], lock: threading.Lock) -> ThreadLanes:
    """Lanes whose every insert counts the inserts running at once in ``running``
    (now, most), across every lanes sharing ``running``."""
    lanes = ThreadLanes(width, permits)

    def insert() -> None:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        threading.Event().wait(0.002)
        with lock:
            running[0] -= 1

    lanes.run([insert for _ in range(inserts)])
    return lanes


def test_tasks_sharing_permits_never_exceed_them_together(tmp_path: Path) -> None:
    """Two tasks of 4 lanes each under 3 executor-wide permits: never more than 3
    inserts in flight between them, and every insert runs."""
    permits = SharedPermits(tmp_path, 3)
    lock, running = threading.Lock(), [0, 0]
    tasks = [threading.Thread(target=_in_flight, args=(permits, 4, 60, running, lock))
             for _ in range(2)]
    for task in tasks:
        task.start()
    for task in tasks:
        task.join(WAIT)
    assert running[0] == 0 and 1 <= running[1] <= 3


def test_a_task_alone_uses_every_permit(tmp_path: Path) -> None:
    """While the executor's other tasks read, decode or have ended, one task's lanes
    run as many inserts as there are permits (up to its own width)."""
    permits = SharedPermits(tmp_path, 4)
    lanes = ThreadLanes(4, permits)
    together = threading.Barrier(4, timeout=WAIT)

    def insert() -> None:
        together.wait()

    lanes.run([insert for _ in range(4)])
    lanes.close()


def test_permits_bound_other_processes_and_a_killed_one_frees_its_own(
        tmp_path: Path) -> None:
    """The permits are files locked with ``flock``: a Python worker process holding
    the only permit keeps this process's insert waiting, and once that worker is
    killed (-9) the permit is free."""
    ready = tmp_path / "held"
    holder = subprocess.Popen([
        sys.executable, "-c",
        "import sys, time, pathlib\n"
        "from blockagg.aggregator.lanes import SharedPermits\n"
        f"p = SharedPermits(pathlib.Path({str(tmp_path / 'permits')!r}), 1)\n"
        "with p.hold():\n"
        f"    pathlib.Path({str(ready)!r}).touch()\n"
        "    time.sleep(600)\n"])
    try:
        deadline = time.monotonic() + WAIT
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready.exists()
        permits = SharedPermits(tmp_path / "permits", 1)
        got = threading.Event()

        def insert() -> None:
            with permits.hold():
                got.set()

        waiting = threading.Thread(target=insert)
        waiting.start()
        assert not got.wait(0.3)  # the other process holds the only permit
        holder.kill()
        holder.wait(WAIT)
        assert got.wait(WAIT)
        waiting.join(WAIT)
    finally:
        holder.kill()


def test_a_failure_while_lanes_wait_for_permits_starts_no_further_insert(
        tmp_path: Path) -> None:
    """A lane that took an insert and waits for a permit does not start it once
    another lane's insert failed."""
    permits = SharedPermits(tmp_path, 1)
    started: list[int] = []

    def insert(i: int) -> Callable[[], None]:
        def run() -> None:
            started.append(i)
            raise RuntimeError(f"insert {i} refused")
        return run

    lanes = ThreadLanes(3, permits)
    with pytest.raises(RuntimeError, match="refused"):
        lanes.run([insert(i) for i in range(10)])
    assert len(started) == 1  # the other two lanes each held an insert, waiting
    lanes.close()


def test_permits_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="executor insert concurrency must be >= 1"):
        SharedPermits(tmp_path, 0)


def test_insert_lanes_follow_the_configuration(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``insert_concurrency = 1`` alone is the serial executor; with
    ``executor_insert_concurrency`` even one lane holds a permit for each insert."""
    from blockagg.aggregator.core.protocol import SERIAL
    from blockagg.config import loads
    from blockagg.spark import components
    from tests.unit.test_config import MINIMAL

    monkeypatch.setattr(components, "executor_permits_dir",
                        lambda count: tmp_path / f"insert-permits-{count}")
    serial = loads(MINIMAL + "[clickhouse]\ninsert_concurrency = 1\n")
    assert components.insert_lanes(serial) is SERIAL
    shared = loads(MINIMAL + "[clickhouse]\ninsert_concurrency = 1\n"
                   "executor_insert_concurrency = 2\n")
    lanes = components.insert_lanes(shared)
    assert isinstance(lanes, ThreadLanes) and lanes.permits is not None
    assert (lanes.width, lanes.permits.count) == (1, 2)
    assert lanes.permits.directory == tmp_path / "insert-permits-2"


def _holding(permits: SharedPermits) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds one of ``permits`` until the returned event is set;
    returns once it holds it."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with permits.hold():
            held.set()
            release.wait(WAIT)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(WAIT)
    return thread, release


def test_only_one_waiting_lane_looks_for_a_permit(tmp_path: Path) -> None:
    """Lanes waiting for a permit wait for the queue file in the kernel; only its
    holder polls, so five waiters look about as often as one would."""
    permits = SharedPermits(tmp_path, 1, poll_s=0.01)
    looks = [0]
    take = permits._take

    def counted(fds: list[int], start: int) -> int | None:
        looks[0] += 1
        return take(fds, start)

    permits._take = counted  # type: ignore[method-assign]
    first, released = _holding(permits)

    def waiter() -> None:
        with permits.hold():
            pass

    waiters = [threading.Thread(target=waiter) for _ in range(5)]
    for w in waiters:
        w.start()
    time.sleep(0.3)
    during = looks[0]
    released.set()
    for thread in [first, *waiters]:
        thread.join(WAIT)
    # one poller over 0.3 s at 10 ms: ~30 looks, plus each lane's first; five: ~150
    assert during < 60, during


def test_a_lane_that_frees_a_permit_queues_behind_the_lanes_waiting(tmp_path: Path) -> None:
    """One task's lane frees the only permit and asks again at once, twenty times;
    another task's lane, waiting since the first hold, gets the permit next. (When a
    lane could take back the permit it had just freed, the waiting one looked in
    the microseconds between and all but never got it.)"""
    permits = SharedPermits(tmp_path, 1)
    order: list[str] = []
    held, waiting = threading.Event(), threading.Event()

    def busy() -> None:
        for i in range(20):
            with permits.hold():
                order.append("busy")
                if i == 0:
                    held.set()
                    assert waiting.wait(WAIT)
                threading.Event().wait(0.002)

    def other() -> None:
        assert held.wait(WAIT)
        with permits.hold():
            order.append("other")

    threads = [threading.Thread(target=busy), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # the other lane is in the queue, waiting for the permit
    waiting.set()
    for thread in threads:
        thread.join(WAIT)
    assert order.index("other") == 1, order


def test_a_release_wakes_the_waiting_lane_without_a_poll(tmp_path: Path) -> None:
    """A freed permit is taken at once by the lane waiting for it, not at its next
    look: with looks a minute apart, the waiter still gets the permit."""
    permits = SharedPermits(tmp_path, 1, poll_s=WAIT * 2)
    first, release = _holding(permits)
    got = threading.Event()

    def waiter() -> None:
        with permits.hold():
            got.set()

    second = threading.Thread(target=waiter)
    second.start()
    time.sleep(0.2)  # the waiter has looked once and sleeps
    release.set()
    assert got.wait(WAIT)
    for thread in (first, second):
        thread.join(WAIT)


def test_a_lanes_permit_files_close_when_its_thread_ends(tmp_path: Path) -> None:
    """Each thread opens its own descriptors of the permit files; a thread that ends
    leaves none open (tasks' lane pools come and go with the workers)."""
    permits = SharedPermits(tmp_path, 4)

    def insert() -> None:
        with permits.hold():
            pass

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        thread = threading.Thread(target=insert)
        thread.start()
        thread.join(WAIT)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_permits_directory_without_fifos_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses the wake FIFO stops the job at its lanes, naming the
    directory and the two ways out, instead of an insert failing later."""
    def refuse(path: Any, mode: int = 0o666) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "mkfifo", refuse)
    with pytest.raises(ConfigError, match="executor_insert_concurrency = 0") as info:
        SharedPermits(tmp_path / "permits", 2)
    assert str(tmp_path / "permits") in str(info.value)
