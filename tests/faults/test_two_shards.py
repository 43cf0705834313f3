"""The two-shard workload (issue 27, eBay's one topic per shard), without a stack: the
stream split between the shards' topics, each shard's ground truth its own topic's,
rebuilt from those topics alone, one job configured with both, and a one-shard run
drawing exactly what it drew before."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from blockagg.config import load
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from tests.faults import checker
from tests.faults.test_resume import _Delivered
from tests.faults.workload import ROW_MESSAGE, Workload, row_descriptor_set


def _two_shards(seed: int) -> Workload:
    return Workload("unused:1", "127.0.0.1", [9000, 9001], tables=3, partitions=2,
                    rows_per_message=3, dead_every=7, seed=seed, run="two1",
                    other_shards=[[9200, 9201]])


def _write(w: Workload, messages: int) -> dict[tuple[str, int], list[bytes]]:
    """``messages`` routed as :meth:`Workload.produce` routes them, delivered in memory."""
    written: dict[tuple[str, int], list[bytes]] = {}
    for _ in range(messages):
        shard, table, ids, value = w.route()
        topic, p = w.topics[shard], w._counter % w.partitions
        at = written.setdefault((topic, p), [])
        w._delivery(table, ids, shard)(None, _Delivered(topic, p, len(at), value))
        at.append(value)
    return written


def test_the_stream_is_split_between_the_shards_topics() -> None:
    w = _two_shards(seed=3)
    _write(w, 400)
    assert w.topics == ["fx-two1", "fx-two1-s2"]
    assert w.replica_shards == [0, 0, 1, 1]
    counts = checker.produced_counts(w)
    for shard in (0, 1):
        rows = sum(n for t, n in counts[shard].items() if t != w.dead_letter_table)
        assert rows > 400, f"shard {shard + 1} got too little of the stream: {counts}"
        assert counts[shard][w.dead_letter_table] > 5, counts
    for table in w.table_names():
        first, second = w.produced.ids_of(table, 0), w.produced.ids_of(table, 1)
        assert first.size and second.size and not np.intersect1d(first, second).size
        assert np.array_equal(np.sort(w.produced.ids_of(table)),
                              np.sort(np.concatenate([first, second])))
    assert {c[0] for c in w.produced.dead} == set(w.topics)


def test_a_one_shard_run_draws_what_it_drew_before() -> None:
    """The shard draw has its own generator: a one-shard run's tables, ids and values are
    the same message for message as :meth:`Workload.message` alone gives."""
    routed = Workload("unused:1", "127.0.0.1", [1], tables=5, dead_every=7, seed=11, run="a")
    plain = Workload("unused:1", "127.0.0.1", [1], tables=5, dead_every=7, seed=11, run="a")
    two = Workload("unused:1", "127.0.0.1", [1], tables=5, dead_every=7, seed=11, run="a",
                   other_shards=[[2]])
    for _ in range(200):
        shard, r_table, r_ids, r_value = routed.route()
        _, t_table, _, _ = two.route()
        table, ids, value = plain.message()
        assert shard == 0 and r_table == table == t_table and r_value == value
        assert (ids is None and r_ids is None) or np.array_equal(np.asarray(r_ids), np.asarray(ids))


def test_each_shards_truth_is_rebuilt_from_its_topic(tmp_path: Path) -> None:
    written = _two_shards(seed=5)
    store = MemoryStore()
    for name in written.table_names():
        register(store, name, ROW_MESSAGE, row_descriptor_set())
    chunks: list[tuple[str, int, int, list[bytes | None]]] = [
        (topic, p, 0, list(values)) for (topic, p), values in _write(written, 300).items()]
    registrations = {r.table: r for r in Registry.from_records(store.read()).registrations()}
    resumed = _two_shards(seed=5)
    resumed.restore(chunks, registrations)
    for shard in (0, 1):
        for table in written.table_names():
            assert np.array_equal(np.sort(resumed.produced.ids_of(table, shard)),
                                  np.sort(written.produced.ids_of(table, shard)))
    assert resumed.produced.dead == written.produced.dead

    # a topic_recreate retires both topics; a resume reads back what each shard kept
    stored = {(s, t): written.produced.ids_of(t, s)[::2] for s in (0, 1)
              for t in written.table_names()}
    written.retire_incarnation(stored, Counter())
    written.save_retired(tmp_path / "retired.npz")
    again = _two_shards(seed=5)
    again.restore([], registrations, tmp_path / "retired.npz")
    for key, ids in stored.items():
        assert np.array_equal(np.sort(again.produced.ids_of(key[1], key[0])), np.sort(ids))


def test_one_job_delivers_each_topic_into_its_shard(tmp_path: Path) -> None:
    w = _two_shards(seed=1)
    path = w.job_config(tmp_path / "job.toml", tmp_path / "checkpoint",
                        ["127.0.0.1:19000", "127.0.0.1:19001"],
                        other_replicas=[["127.0.0.1:19200", "127.0.0.1:19201"]])
    topics = load(path).topics
    assert [(t.name, [str(r) for r in t.replicas]) for t in topics] == [
        ("fx-two1", ["127.0.0.1:19000", "127.0.0.1:19001"]),
        ("fx-two1-s2", ["127.0.0.1:19200", "127.0.0.1:19201"])]
    one = Workload("unused:1", "127.0.0.1", [1, 2], run="one1")
    config = one.job_config(tmp_path / "one.toml", tmp_path / "c",
                            ["127.0.0.1:1", "127.0.0.1:2"])
    assert [t.name for t in load(config).topics] == ["fx-one1"]


def test_the_counts_are_read_while_the_producer_adds() -> None:
    """The long run's harness died of "Set changed size during iteration": a stream's
    catch-up wait counted each topic's dead letters while the producing thread added
    one. Readers iterate snapshots; here a thread adds while the counts are read."""
    import threading

    from tests.faults.workload import Produced

    produced = Produced()
    produced.dead.update(("a" if i % 2 else "b", 0, i) for i in range(20_000))
    stop = threading.Event()

    def produce() -> None:  # sizes change all the time, yet stay bounded
        offset = 0
        while not stop.is_set():
            produced.dead.add(("a", 1, offset % 1000))
            produced.dead.discard(("a", 1, (offset + 500) % 1000))
            produced.ids[(0, f"t{offset % 100}")] = [np.zeros(1)]
            produced.ids.pop((0, f"t{(offset + 50) % 100}"), None)
            offset += 1

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            assert produced.dead_count("b") == 10_000
            produced.ids_of("t1")
    finally:
        stop.set()
        thread.join()


def test_the_operators_procedure_waits_for_a_recreated_topics_leaders() -> None:
    """``topic_recreate`` on three brokers read a new partition's watermarks before its
    leader was known to the broker asked (``NOT_LEADER_FOR_PARTITION``) and the harness
    died half-way through the procedure; then a client whose metadata did not list the
    recreated partition yet (``_UNKNOWN_PARTITION``) killed it at the same step. Such
    errors are retried, others are not."""
    import pytest
    from confluent_kafka import KafkaError, KafkaException

    from tests.faults.workload import while_leaders_settle

    answers: list[object] = [KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)),
                             KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE)),
                             KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION)),
                             (0, 42)]

    def watermarks() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert while_leaders_settle(watermarks, 30, sleep=lambda s: None) == (0, 42)
    with pytest.raises(KafkaException):
        while_leaders_settle(lambda: (_ for _ in ()).throw(
            KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))), 30,
            sleep=lambda s: None)


def test_a_replica_that_died_by_itself_is_started_again_while_a_step_retries() -> None:
    """18.16 aborted by itself on the loaded machine and ``topic_recreate``'s read of
    what is stored waited 180 s for it, then killed the harness; the step now starts a
    replica that is down (and only then) before it retries."""
    from tests.faults.driver import _retry_for, revive_replicas

    class Stack:
        replica_services = ("clickhouse-r1", "clickhouse-r2")

        def __init__(self) -> None:
            self.running = {"clickhouse-r2"}
            self.ups = 0

        def is_up(self, service: str) -> bool:
            return service in self.running

        def up(self) -> None:
            self.ups += 1
            self.running |= set(self.replica_services)

    stack = Stack()

    def stored() -> int:
        if "clickhouse-r1" not in stack.running:
            raise ConnectionRefusedError("Code: 210. Connection refused (127.0.0.1:27000)")
        return 7

    assert _retry_for(stored, 30, "reading what is stored",
                      lambda: revive_replicas(stack)) == 7  # type: ignore[arg-type]
    assert stack.ups == 1
    revive_replicas(stack)  # type: ignore[arg-type]
    assert stack.ups == 1
