"""blockagg.aggregator.clickhouse.dedup_window and the guard in plan_batch: each
partition-batch forms at most floor(W_t / (2 x P)) blocks of a table, so a replay
stays in the table's deduplication window (issue 25, path 5 and the grouping item)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.dedup_window import (
    DedupNeed,
    expected_blocks,
    judge_window,
    replica_keys,
    shard_partitions,
)
from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall
from blockagg.aggregator.core.blocks import form_blocks
from blockagg.aggregator.core.exceptions import BatchRefused, TooManyBlocks
from blockagg.aggregator.core.model import (
    BATCHES_IN_FLIGHT,
    Batch,
    Block,
    BlockShare,
    Thresholds,
)
from blockagg.aggregator.core.protocol import plan_batch
from blockagg.config import Replica, loads
from tests.unit.core.fakes import (
    DedupSink,
    MemoryMetadataStore,
    expected_rows,
    make_batch,
    run_crashing,
    table_name,
)


def old_need(partitions: int, max_offsets_per_trigger: int | None, max_rows: int) -> int:
    """The need before issue 25: 2 x (partitions + ceil(max_offsets_per_trigger /
    max_rows)), which assumed one small row per message."""
    extra = 0 if max_offsets_per_trigger is None else math.ceil(
        max_offsets_per_trigger / max_rows)
    return 2 * (partitions + extra)


# ------------------------------------------------------------------ start-up judgement


def test_a_window_below_one_block_per_partition_batch_is_refused() -> None:
    """P = 50 partitions on the shard: a window of 100 gives each partition-batch a
    share of 1 block (taken); 99 gives 0 (refused, naming table, window, P and the
    minimum 2 x P); allow_small_dedup_window turns it into a warning."""
    need = DedupNeed(partitions=50)
    assert need.minimum == 100 and need.share(100) == 1 and need.share(99) == 0
    assert judge_window("db.t", "replicated_deduplication_window", 100, need, False) is None
    with pytest.raises(DedupWindowTooSmall) as info:
        judge_window("db.events", "replicated_deduplication_window", 99, need, False)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("table db.events: replicated_deduplication_window = 99 is below "
                           "the 100 blocks (2 batches in flight x 50 partitions on the shard")
    assert "at least 100" in text and "allow_small_dedup_window" in text
    warning = judge_window("db.events", "replicated_deduplication_window", 99, need, True)
    assert warning is not None and "below the 100 blocks" in warning


def test_a_share_below_what_the_batches_are_expected_to_form_is_a_warning() -> None:
    """max_offsets_per_trigger 20000, max_rows 1000: a partition-batch receiving the
    whole batch forms 1 + 20 = 21 blocks of one table; a window of 100 over 3
    partitions gives 16: started, with a warning naming the window to size to."""
    config = loads('[job]\ncheckpoint_location = "/tmp/ck"\nmax_offsets_per_trigger = 20000\n'
                   '[blocks]\nmax_rows = 1000\n[kafka]\n"bootstrap.servers" = "x:1"\n'
                   '[[topics]]\nname = "t"\nreplicas = ["ch:9000"]\n')
    assert expected_blocks(config) == 21
    need = DedupNeed(3, expected_blocks(config))
    warning = judge_window("db.t", "replicated_deduplication_window", 100, need, False)
    assert warning is not None and "holds 16 blocks per partition-batch" in warning
    assert "TooManyBlocks" in warning and "at least 126" in warning
    assert judge_window("db.t", "replicated_deduplication_window", 126, need, False) is None


def test_the_default_configuration_starts_on_clickhouses_default_window() -> None:
    """Invariant 7 without a 50-message batch: max_offsets_per_trigger stays unset by
    default (no expectation to warn about), and ClickHouse's default window of 100
    takes up to 50 partitions on a shard."""
    config = loads('[job]\ncheckpoint_location = "/tmp/ck"\n[kafka]\n'
                   '"bootstrap.servers" = "x:1"\n[[topics]]\nname = "t"\n'
                   'replicas = ["ch:9000"]\n')
    assert config.job.max_offsets_per_trigger is None and expected_blocks(config) is None
    assert judge_window("db.t", "replicated_deduplication_window", 100,
                        DedupNeed(50, expected_blocks(config)), False) is None


# --------------------------------------------------------------------------- the guard


def _batch(partition: int, rows: Sequence[int], sizes: Sequence[int],
           tables: Sequence[int], start: int = 0) -> Batch:
    n = len(rows)
    return Batch(topic="events", partition=partition, start=start, end=start + n,
                 offsets=np.arange(start, start + n, dtype=np.int64),
                 table_ids=np.asarray(tables, dtype=np.int64),
                 row_counts=np.asarray(rows, dtype=np.int64),
                 sizes=np.asarray(sizes, dtype=np.int64), payloads=[None] * n,
                 tables={t: table_name(t) for t in set(tables)})


def test_messages_reaching_max_bytes_seal_a_block_each_beyond_the_old_need() -> None:
    """Path 5 of issue 25: messages reaching blocks.max_bytes are one block each: 20
    per partition-batch where the old need assumed 1. The guard counts the blocks
    formed, not an assumption: a share of 19 refuses the batch, 20 takes it."""
    thresholds = Thresholds(max_rows=1_000_000, max_bytes=1_000)
    batch = _batch(0, [1] * 20, [1_000] * 20, [1] * 20)
    assert len(form_blocks(batch, 0, {}, thresholds).blocks) == 20
    assert old_need(1, 20, 1_000_000) // 2 == 2 < 20
    with pytest.raises(TooManyBlocks):
        plan_batch(batch, None, Thresholds(1_000_000, 1_000, 4096, (BlockShare(1, 76, 2),)),
                   1, 1)
    plan = plan_batch(batch, None, Thresholds(1_000_000, 1_000, 4096, (BlockShare(1, 80, 2),)),
                      1, 1)
    assert len(plan.blocks) == 20


def test_the_refusal_names_partition_range_table_blocks_share_and_fixes() -> None:
    batch = _batch(3, [1] * 5, [10] * 5, [2] * 5, start=40)
    shares = (BlockShare(2, 12, 3),)  # floor(12 / (2 x 3)) = 2
    with pytest.raises(TooManyBlocks) as info:
        plan_batch(batch, None, Thresholds(1, 1 << 20, 4096, shares), 1, 7)
    text = str(info.value)
    assert isinstance(info.value, BatchRefused) and "\n" not in text
    assert text.startswith("events[3] batch [40, 45) forms 5 blocks of table db.t2, above "
                           "the partition's share of its deduplication window: 2 = floor("
                           "window 12 / (2 batches in flight x 3 partitions on the shard))"), text
    assert "nothing was committed or inserted" in text
    assert "window to at least 30" in text and "blocks.max_rows / blocks.max_bytes" in text
    assert "job.max_offsets_per_trigger" in text
    from blockagg.spark.driver import refusal_reasons

    assert refusal_reasons(f"TooManyBlocks: {text}") == ["too_many_blocks"]


def test_replay_blocks_and_the_dead_letter_table_count_too() -> None:
    """A replay block is a block formed in the partition-batch: the replayed block of
    table 1 and the two formed after it are 3, above a share of floor(4 / (2 x 2)) =
    1. The dead-letter table (id 0) has its share like any table."""
    thresholds = Thresholds(max_rows=2, max_bytes=1 << 20)
    messages = [(offset, 1, 1) for offset in range(6)]
    store, sink = MemoryMetadataStore(), DedupSink()
    first = plan_batch(make_batch(messages, 0, 6), None, thresholds, 1, 1)
    assert not run_crashing(first, store, sink, at=1, after=True)
    retry = make_batch(messages, 0, 6)
    shared = Thresholds(2, 1 << 20, 4096, (BlockShare(1, 4, 2),))
    with pytest.raises(TooManyBlocks, match=r"forms 3 blocks of table db\.t1"):
        plan_batch(retry, store.committed("events", 0), shared, 1, 1)
    dead = _batch(0, [1] * 3, [10] * 3, [0] * 3)
    with pytest.raises(TooManyBlocks, match=r"forms 3 blocks of table db\.t0"):
        plan_batch(dead, None, Thresholds(1, 1 << 20, 4096, (BlockShare(0, 4, 1),)), 1, 1)


def _replay_after_two_batches(window: int, guarded: bool) -> tuple[DedupSink, MemoryMetadataStore]:
    """Two partitions into one table (P = 2), 20 messages each per batch, every
    message reaching max_bytes. Partition 0's first block lands and its
    acknowledgement is lost; partition 1 inserts its blocks of that batch and of the
    next; then partition 0's retry replays its intent. ``guarded``: plan_batch gets the
    table's share of ``window``; the first plan refused stops the run."""
    shares = (BlockShare(1, window, 2),) if guarded else ()
    thresholds = Thresholds(max_rows=1_000, max_bytes=10, max_blocks_per_table=shares)
    messages = [(offset, 1, 1) for offset in range(20)]  # partition 0
    others = [(offset, 1, 1) for offset in range(100, 140)]  # partition 1
    store, sink = MemoryMetadataStore(), DedupSink(window=window)

    def batch(partition: int, start: int, end: int) -> Any:
        return make_batch(others if partition else messages, start, end,
                          partition=partition, bytes_per_row=10)

    try:
        first = plan_batch(batch(0, 0, 20), None, thresholds, 1, 1)
    except TooManyBlocks:
        return sink, store
    assert not run_crashing(first, store, sink, at=1, after=True)
    assert len(sink.inserted) == 1
    for start, batch_id in ((100, 1), (120, 2)):
        plan = plan_batch(batch(1, start, start + 20), store.committed("events", 1),
                          thresholds, 1, batch_id)
        assert run_crashing(plan, store, sink, None)
    retry = plan_batch(batch(0, 0, 20), store.committed("events", 0), thresholds, 1, 2)
    assert run_crashing(retry, store, sink, None)
    return sink, store


def test_a_replay_stored_twice_under_the_old_need_is_refused_by_the_guard() -> None:
    """The core model with the project's fakes. A window equal to the old need (2 x
    (2 partitions + ceil(40 / 1000)) = 6) stores the replayed block's row twice
    without the guard; with it, the share is floor(6 / (2 x 2)) = 1 block and the
    first partition-batch (20 blocks) is refused: nothing committed or inserted. A
    window of 2 x 2 x 20 = 80 takes every batch and stores every row once."""
    expected = expected_rows([(offset, 1, 1) for offset in [*range(20), *range(100, 140)]])
    unguarded, _ = _replay_after_two_batches(old_need(2, 40, 1_000), guarded=False)
    assert unguarded.duplicates() == [("db.t1", 0, 0)]
    refused, store = _replay_after_two_batches(old_need(2, 40, 1_000), guarded=True)
    assert refused.inserted == [] and store.committed("events", 0) is None
    assert store.committed("events", 1) is None
    large, _ = _replay_after_two_batches(BATCHES_IN_FLIGHT * 2 * 20, guarded=True)
    assert large.rows == expected and large.duplicates() == []
    assert len(large.deduplicated) == 1


class WindowedSink(DedupSink):
    """:class:`DedupSink` with a window per table, and the order of every insert."""

    def __init__(self, windows: dict[str, int]) -> None:
        super().__init__()
        self.windows = windows
        self.log: list[Block] = []

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.window = self.windows[block.table]
        self.log.append(block)
        super().insert(block, batch, confirmed_at)


@st.composite
def shards(draw: st.DrawFn) -> dict[str, Any]:
    """P partitions (1-5) of one shard over 1-3 tables, two batches each, messages of
    any rows and bytes, any thresholds, any windows of at least 2 x P."""
    partitions = draw(st.integers(1, 5))
    tables = draw(st.integers(1, 3))
    windows = {t: draw(st.integers(2 * partitions, 2 * partitions * 16))
               for t in range(1, tables + 1)}
    messages = []
    for partition in range(partitions):  # offsets apart: the sink keys rows by offset
        n = draw(st.integers(1, 24))
        messages.append([(1000 * partition + i, draw(st.integers(1, tables)),
                          draw(st.integers(1, 5))) for i in range(n)])
    return {"thresholds": (draw(st.integers(1, 24)), draw(st.integers(1, 300))),
            "windows": windows, "messages": messages,
            "split": [draw(st.integers(min(i == 0, len(m)), len(m)))
                      for i, m in enumerate(messages)],
            "crash": draw(st.integers(0, 4)), "bytes_per_row": draw(st.integers(1, 30))}


@settings(max_examples=250, derandomize=True, deadline=None)
@given(shards())
def test_without_a_refusal_every_replay_stays_in_its_tables_window(case: dict[str, Any]
                                                                   ) -> None:
    """Whatever thresholds, partitions, tables, rows and bytes: when no partition-batch
    is refused, the blocks reaching a table between a block's first attempt and its
    replay fit the table's window, and every row is stored once. Worst order of the
    two batches in flight: partition 0's first batch crashes after an acknowledged
    operation; every other partition runs both its batches; then partition 0 replays."""
    max_rows, max_bytes = case["thresholds"]
    windows = case["windows"]
    partitions = len(case["messages"])
    shares = tuple(BlockShare(t, w, partitions) for t, w in windows.items())
    thresholds = Thresholds(max_rows, max_bytes, 1 << 20, shares)
    store = MemoryMetadataStore()
    sink = WindowedSink({table_name(t): w for t, w in windows.items()})

    def batch(partition: int, which: int) -> Batch:
        messages, split = case["messages"][partition], case["split"][partition]
        base = 1000 * partition
        start, end = (base, base + split) if which == 0 else (base + split,
                                                              base + len(messages))
        return make_batch(messages, start, end, partition=partition,
                          bytes_per_row=case["bytes_per_row"])

    def run(partition: int, which: int, crash: int | None = None) -> bool:
        plan = plan_batch(batch(partition, which), store.committed("events", partition),
                          thresholds, 1, which + 1)
        for table, count in _blocks_per_table(plan.blocks).items():
            assert count <= windows[table] // (BATCHES_IN_FLIGHT * partitions)
        return run_crashing(plan, store, sink, crash, after=True)

    try:
        if run(0, 0, case["crash"]):
            return  # no crash inside the batch: nothing replays
        for partition in range(1, partitions):
            assert run(partition, 0) and run(partition, 1)
        assert run(0, 0) and run(0, 1)
    except TooManyBlocks:
        return
    replayed = [i for i, block in enumerate(sink.log) if block.replay]
    for i in replayed:
        token = sink.log[i].token
        first = next(j for j, b in enumerate(sink.log) if b.token == token)
        table = sink.log[i].table
        stored_between = {b.token for b in sink.log[first + 1:i] if b.table == table}
        assert len(stored_between) <= sink.windows[table]
    expected: Counter[tuple[str, int, int]] = Counter()
    for partition_messages in case["messages"]:
        expected.update(expected_rows(partition_messages))
    assert sink.duplicates() == [] and sink.rows == expected


def _blocks_per_table(blocks: Sequence[Block]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for block in blocks:
        counts[block.table_id] = counts.get(block.table_id, 0) + 1
    return counts


@settings(max_examples=150, derandomize=True, deadline=None)
@given(shards())
def test_the_shares_never_change_the_blocks(case: dict[str, Any]) -> None:
    """The guard only takes or refuses a batch: a plan taken under shares has the
    blocks and operations of the plan without them (invariant 3)."""
    max_rows, max_bytes = case["thresholds"]
    partitions = len(case["messages"])
    shares = tuple(BlockShare(t, w, partitions) for t, w in case["windows"].items())
    for partition, messages in enumerate(case["messages"]):
        batch = make_batch(messages, 1000 * partition, 1000 * partition + len(messages),
                           partition=partition, bytes_per_row=case["bytes_per_row"])
        free = plan_batch(batch, None, Thresholds(max_rows, max_bytes, 1 << 20), 1, 1)
        try:
            guarded = plan_batch(batch, None, Thresholds(max_rows, max_bytes, 1 << 20, shares),
                                 1, 1)
        except TooManyBlocks:
            counts = _blocks_per_table(free.blocks)
            assert any(counts.get(s.table_id, 0) > s.blocks for s in shares)
            continue
        assert repr(guarded.blocks) == repr(free.blocks)  # Block compares by identity
        assert repr(list(guarded)) == repr(list(free))


# ------------------------------------------------------------------------ grouping


def test_topics_sharing_a_replica_or_a_shard_identity_are_one_shard() -> None:
    """Reported with issue 25: the need was grouped by the exact replica list, so two
    topics writing one shard under different spellings or subsets of its replicas each
    counted their own 41 partitions where 82 write the shard. Any shared key (a replica
    address, the servers' shard identity) joins them, transitively; another shard
    stays apart."""
    keys = {
        "a": {"address:127.0.0.1:19000", "address:127.0.0.1:19100"},
        "b": {"address:127.0.0.1:19100"},  # a subset of a's replicas
        "c": {"address:10.0.0.9:9000", "zookeeper:/clickhouse/tables/01/db/dead_letters"},
        "d": {"address:10.0.0.8:9000", "zookeeper:/clickhouse/tables/01/db/dead_letters"},
        "e": {"address:10.0.0.7:9000", "zookeeper:/clickhouse/tables/02/db/dead_letters"},
    }
    counts = shard_partitions(keys, {"a": 41, "b": 41, "c": 8, "d": 4, "e": 16})
    assert counts == {"a": 82, "b": 82, "c": 12, "d": 12, "e": 16}
    chain = shard_partitions({"x": {"k1"}, "y": {"k2"}, "z": {"k1", "k2"}},
                             {"x": 1, "y": 2, "z": 3})
    assert chain == {"x": 6, "y": 6, "z": 6}


def test_two_spellings_of_one_host_give_one_key() -> None:
    resolve = {"localhost": ["127.0.0.1", "::1"], "127.0.0.1": ["127.0.0.1"]}
    keys_a = replica_keys([Replica("127.0.0.1", 19000)], lambda h, p: resolve[h])
    keys_b = replica_keys([Replica("localhost", 19000)], lambda h, p: resolve[h])
    assert keys_a & keys_b == {"address:127.0.0.1:19000"}
    assert replica_keys([Replica("localhost", 19100)], lambda h, p: resolve[h]).isdisjoint(
        keys_a)

    def fails(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    assert replica_keys([Replica("CH1.example", 9000)], fails) == {"host:ch1.example:9000"}


TWO_SPELLINGS = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "a"
replicas = ["127.0.0.1:19000", "127.0.0.1:19001"]
[[topics]]
name = "b"
replicas = ["localhost:19001"]
[[topics]]
name = "c"
replicas = ["r9.invalid:19000"]
[[topics]]
name = "d"
replicas = ["r8.invalid:19000"]
"""


def test_the_driver_counts_every_partition_writing_the_shard(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's P for each topic: a and b spell one shard's replicas differently
    (41 + 41 = 82 each, not 41: a window of 100 then gives each partition-batch 0
    blocks and is refused); c and d list different hosts of one shard, which the
    servers name alike (the dead-letter table's ZooKeeper path)."""
    from unittest.mock import MagicMock

    from blockagg.spark import components
    from blockagg.spark.driver import Driver

    class Writer:
        def __init__(self, host: str) -> None:
            self.host = host

        def shard_identity(self, table: str) -> str | None:
            assert table == "blockagg.dead_letters"
            return "zookeeper:/shard-cd" if self.host.endswith(".invalid") else None

        def close(self) -> None:
            pass

    monkeypatch.setattr(components, "make_writer",
                        lambda config, topic: Writer(topic.replicas[0].host))
    driver = Driver(loads(TWO_SPELLINGS), MagicMock(), components=MagicMock(), run_id=1)
    partitions = [*((t, p) for t in "ab" for p in range(41)), ("c", 0), ("d", 0), ("d", 1)]
    driver.count_shard_partitions(partitions)
    assert {t: driver.shard_partitions[t] for t in "abcd"} == {"a": 82, "b": 82, "c": 3, "d": 3}
    topic_a = driver.config.topics[0]
    need = driver.dedup_need(topic_a)
    assert need.partitions == 82 and need.share(100) == 0
    with pytest.raises(DedupWindowTooSmall, match="82 partitions on the shard"):
        judge_window("db.t", "replicated_deduplication_window", 100, need, False)
