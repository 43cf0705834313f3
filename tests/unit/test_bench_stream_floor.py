"""The pure parts of ``bench.bench_stream_floor`` (issue 28 item 2): the job's batch
lines into per-batch blocks and rows, one batch's blocks rebuilt (sizes and their
tables and partitions), the ratio, the percentile, the ABBA order of a round's parts
and the report. No stack: the runs are measured by hand (docs/BENCHMARKS.md)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_curves import abba
from bench.bench_stream_floor import (
    ROUND,
    Batch,
    Round,
    even_sizes,
    layout,
    percentile,
    ratio,
    stream_figures,
    table,
    window_batches,
)

LOG = """\
2026-11-27 08:00:01 INFO blockagg.job: batch kind=stream batch=3 run=00ab partitions=2 \
messages=190 rows=1810 bytes=90000 blocks=22 replayed_blocks=0 dead_letters=0 skipped=0 \
commits=4 seconds=9.5 max_task_seconds=4.1 task_seconds=8.0 commit_seconds=1.0 \
insert_seconds=6.0
2026-11-27 08:00:05 INFO blockagg.job: batch kind=stream batch=4 run=00ab partitions=2 \
messages=0 rows=0 bytes=0 blocks=0 replayed_blocks=0 dead_letters=0 skipped=0 commits=0 \
seconds=0.2 max_task_seconds=0 task_seconds=0 commit_seconds=0 insert_seconds=0
2026-11-27 08:00:11 INFO blockagg.job: batch kind=stream batch=5 run=00ab partitions=2 \
messages=200 rows=2020 bytes=91000 blocks=22 replayed_blocks=0 dead_letters=0 skipped=0 \
commits=4 seconds=11.25 max_task_seconds=5 task_seconds=9 commit_seconds=1 insert_seconds=7
2026-11-27 08:00:12 INFO blockagg.job: batch kind=replay batch=6 run=00ab blocks=5 rows=50 \
seconds=1.0
2026-11-27 08:00:21 INFO blockagg.job: batch kind="stream" batch=7 run=00ab partitions=2 \
messages=201 rows=2030 bytes=91500 blocks=23 replayed_blocks=0 dead_letters=1 skipped=0 \
commits=4 seconds=10.0 max_task_seconds=5 task_seconds=9 commit_seconds=1 insert_seconds=7
"""


def test_window_batches_are_the_streaming_lines_with_blocks_first_excluded() -> None:
    # batch 3 may have begun before the window: excluded; batch 4 inserted nothing;
    # batch 6 is a replay, not a streaming micro-batch
    assert window_batches(LOG) == [Batch(5, 11.25, 2020, 22), Batch(7, 10.0, 2030, 23)]
    assert Batch(5, 11.25, 2020, 22).rows_per_block == pytest.approx(2020 / 22)
    assert window_batches("") == []
    assert window_batches(LOG.splitlines()[0]) == []  # only the excluded first


@settings(max_examples=200, derandomize=True)
@given(st.integers(1, 5000), st.integers(1, 50_000))
def test_even_sizes_rebuild_the_batch_line_blocks_and_rows(blocks: int, extra: int) -> None:
    rows = blocks + extra
    sizes = even_sizes(rows, blocks)
    assert len(sizes) == blocks and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1


def test_even_sizes_refuse_a_line_that_cannot_be_blocks() -> None:
    with pytest.raises(ValueError, match="3 rows do not fill 4 blocks"):
        even_sizes(3, 4)
    with pytest.raises(ValueError, match="do not fill 0 blocks"):
        even_sizes(10, 0)


@settings(max_examples=100, derandomize=True)
@given(st.integers(1, 30), st.integers(1, 8), st.integers(1, 300), st.integers(0, 10**6))
def test_layout_spreads_a_batch_like_the_job(tables: int, partitions: int, blocks: int,
                                             first: int) -> None:
    sizes = even_sizes(blocks * 7, blocks)
    placed = layout(sizes, tables, partitions, first)
    assert [n for *_, n in placed] == sizes
    # consecutive, distinct rows from first on
    assert [r for _, _, r, _ in placed] == [first + 7 * i for i in range(blocks)]
    per_table = Counter(t for t, *_ in placed)
    assert max(per_table.values()) - min(per_table.values()) <= 1
    assert all(0 <= t < tables and 0 <= p < partitions for t, p, *_ in placed)
    if blocks == tables * partitions:
        # a steady batch: one block per table and partition, as the job forms them
        assert len({(t, p) for t, p, *_ in placed}) == blocks


def test_ratio_and_percentile() -> None:
    assert ratio([13.0, 20.0, 15.0], [6.0, 8.0, 4.0]) == pytest.approx(15.0 / 6.0)
    assert ratio([], [6.0]) == 0.0 and ratio([10.0], []) == 0.0
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0], 0.9) == 9.0
    assert percentile([4.0], 0.9) == 4.0 and percentile([], 0.9) == 0.0
    assert percentile([1.0, 2.0], 1.0) == 2.0


def test_rounds_alternate_abba() -> None:
    assert ROUND == ("stream", "alone")
    assert abba(ROUND, 3) == [(0, "stream"), (0, "alone"), (1, "alone"), (1, "stream"),
                              (2, "stream"), (2, "alone")]


def test_stream_figures_and_the_report() -> None:
    r = Round(0, "stream first")
    lat = {"p50_s": 12.0, "p99_s": 25.5, "max_s": 27.0, "seen": 300, "probes": 300,
           "job_cpu_s": 9.0, "server_cpu_s": 6.0}
    stream_figures(r, lat, window_batches(LOG))
    assert r.batches == 2 and r.batch_s_median == pytest.approx(10.625)
    assert r.batch_s_max == 11.25 and r.batch_s_p90 == 11.25
    assert r.blocks_per_batch == 22.5 and r.rows_per_block == pytest.approx(4050 / 45)
    # the window's CPU is over its two batches and the excluded first
    assert r.job_cpu_s_per_batch == pytest.approx(3.0)
    assert r.server_cpu_s_per_batch == pytest.approx(2.0)
    assert r.probes_seen == "300/300"
    r.alone_s_median, r.ratio = 5.0, 10.625 / 5.0
    text = table([r, Round(1, "alone first", p99_s=30.0, ratio=3.0)])
    header, rule, first = text.splitlines()[:3]
    assert header.count("|") == rule.count("|")
    assert "| 0 | stream first | 2 | 10.62 / 11.25 / 11.25 | 5.00 | 2.12 |" in first
    assert text.splitlines()[-1] == ("batch / its inserts alone, median of 2 rounds: 2.56 "
                                     "(target <= 1.3); probe p99, median: 27.8 s")
