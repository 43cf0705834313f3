"""The pure parts of ``bench.bench_curves`` (issue 28 item 4): the points of the four
curves, the ABBA order of a point's runs, the median, the 0.8x verdict, the job log's
batch figures, the metadata figures, the JSON round trip and the 1 KiB row widening.
No stack: the runs themselves are measured by hand (docs/BENCHMARKS.md)."""

from __future__ import annotations

import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_curves import (
    CONTENDERS,
    CURVES,
    CurveError,
    Point,
    PointResult,
    abba,
    batch_figures,
    batch_seconds,
    contenders,
    dump,
    load,
    median,
    metadata_figures,
    on_curve,
    points,
    python_share,
    quorum_waits,
    verdict,
    widen,
)
from bench.workload import Rows


def test_points_are_the_issues_four_curves() -> None:
    every = points()
    assert [(p.curve, p.x) for p in every] == [
        ("tables", 10), ("tables", 100), ("tables", 500), ("tables", 1000),
        ("partitions", 2), ("partitions", 8), ("partitions", 32),
        ("rows_per_message", 1), ("rows_per_message", 10), ("rows_per_message", 100),
        ("row_width", 0), ("row_width", 1024)]
    # each curve varies one thing around the same centre: 100 tables, 8 partitions,
    # 10 rows a message, narrow rows (the tables curve keeps 8 partitions)
    centre = Point("x", "x")
    for p in every:
        for attr in ("tables", "partitions", "rows_per_message", "string_bytes"):
            if attr != {"row_width": "string_bytes"}.get(p.curve, p.curve):
                assert getattr(p, attr) == getattr(centre, attr), (p, attr)


def test_points_selected_and_refused() -> None:
    assert points(["tables", "row_width"], ["10", "1KiB"]) == [
        Point("tables", "10", tables=10), Point("row_width", "1KiB", string_bytes=1024)]
    assert points(selected=["10"]) == [Point("tables", "10", tables=10),
                                       Point("rows_per_message", "10", rows_per_message=10)]
    assert points(selected=["tables=10", "partitions=2"]) == [
        Point("tables", "10", tables=10), Point("partitions", "2", partitions=2)]
    assert points(["tables"], ["tables=100", "tables=33", "10"]) == [
        Point("tables", "10", tables=10), Point("tables", "33", tables=33),
        Point("tables", "100", tables=100)]
    for bad in ("tables=0", "tables=x", "row_width=2", "partitions=-1"):
        with pytest.raises(CurveError, match=rf"unknown points \['{bad}'\]"):
            points(selected=[bad])
    with pytest.raises(CurveError, match=r"unknown points \['tables=33'\]"):
        points(["partitions"], ["tables=33"])
    with pytest.raises(CurveError, match="unknown curve 'rows'"):
        points(["rows"])
    with pytest.raises(CurveError, match=r"unknown points \['1KiB'\]"):
        points(["tables"], ["10", "1KiB"])
    assert isinstance(CurveError("x"), ValueError)


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=5, unique=True),
       st.integers(1, 7))
def test_abba_each_pair_of_repeats_balances_the_order(contenders: list[str],
                                                      repeat: int) -> None:
    plan = abba(contenders, repeat)
    assert len(plan) == repeat * len(contenders)
    for r in range(repeat):
        mine = [c for i, c in plan if i == r]
        assert sorted(mine) == sorted(contenders)  # each contender once a repeat
        if r % 2 == 1:  # with the repeat before it: every contender's mean position equal
            before = [c for i, c in plan if i == r - 1]
            for c in contenders:
                assert before.index(c) + mine.index(c) == len(contenders) - 1
    assert [i for i, _ in plan] == sorted(i for i, _ in plan)  # repeats never interleave


def test_abba_of_the_three_contenders() -> None:
    assert abba(CONTENDERS, 3) == [(0, "job"), (0, "same"), (0, "large"), (1, "large"),
                                   (1, "same"), (1, "job"), (2, "job"), (2, "same"),
                                   (2, "large")]


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(st.lists(st.floats(-1e9, 1e9), min_size=1, max_size=9), st.randoms())
def test_median_is_order_free(xs: list[float], rnd: object) -> None:
    shuffled = list(xs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert median(shuffled) == median(xs) == statistics.median(xs)


def test_median_of_nothing_and_of_three() -> None:
    assert median([]) == 0.0
    assert median([3.0, 100.0, 1.0]) == 3.0  # one slow run of three never moves it


def test_verdict_at_below_and_at_the_floor() -> None:
    assert verdict(0.8, 0.1, 2).startswith("ok")
    assert verdict(1.3, 2.0, 2).startswith("ok")
    cpu = verdict(0.5, 1.9, 2)
    assert cpu.startswith("BELOW 0.8x (0.50x)") and "the job's own CPU" in cpu
    assert "1.90 of 2 cores" in cpu
    wait = verdict(0.79, 0.6, 2)
    assert wait.startswith("BELOW 0.8x (0.79x)") and "waiting, not CPU" in wait
    assert "0.60 of 2 cores" in wait


def test_verdict_names_the_machine_or_the_slots() -> None:
    shared = verdict(0.7, 0.9, 2, servers_cores_used=0.9, machine_cores=2)
    assert "the machine's CPU (job 0.90 + servers 0.90 of 2 cores" in shared
    apart = verdict(0.7, 0.9, 2, servers_cores_used=0.9, machine_cores=8,
                    python_share=0.6)
    assert "waiting, not CPU" in apart and ", servers 0.90" in apart
    assert "task slots 60% in the job's Python, 40% in Spark around it" in apart


def test_python_share_is_the_tasks_part_of_the_slots() -> None:
    line = ("01:02:03 INFO    blockagg.job: batch kind=\"stream\" batch=1 run=\"f6\" "
            "seconds=5.0 task_seconds=6.0 spark_seconds=5.0\n")
    assert python_share(line * 2, 2) == pytest.approx(0.6)
    assert python_share("", 2) is None


LOG = """\
03:03:40 INFO    blockagg.job: batch kind="stream" batch=0 run="f6" partitions=8 \
messages=0 rows=0 bytes=0 blocks=0 replayed_blocks=0 dead_letters=0 commits=0 seconds=0.1
03:03:52 INFO    blockagg.job: batch kind="stream" batch=1 run="f6" partitions=8 \
messages=10000 rows=100000 bytes=7063268 blocks=80 replayed_blocks=0 dead_letters=0 \
skipped=0 commits=16 seconds=13.816 max_task_seconds=1.424
03:03:53 INFO    blockagg.job: batch still running batch=2
03:03:59 INFO    blockagg.job: batch kind="stream" batch=2 run="f6" partitions=8 \
messages=10 rows=20 bytes=70 blocks=4 replayed_blocks=0 seconds=1.0
"""


def test_batch_figures_count_the_batches_that_inserted() -> None:
    assert batch_figures(LOG) == ([80, 4], [100_000, 20])
    assert batch_figures("") == ([], [])


def test_quorum_waits_count_batch_lines_and_an_older_jobs_refusals() -> None:
    line = ('03:03:52 INFO    blockagg.job: batch kind="stream" batch=1 blocks=80 '
            "fresh_workers=0 quorum_waits=7 read_seconds=0.1\n")
    older = ("03:03:52 INFO    blockagg.aggregator.clickhouse.writer: db.t on h:9000 failed "
             "(attempt 1/6): DB::Exception: Quorum for previous write has not been "
             "satisfied yet. Status: version: 1\n")
    assert quorum_waits(line * 2 + older) == 15
    assert quorum_waits(LOG) == 0


def test_batch_seconds_sum_every_batch_line() -> None:
    assert batch_seconds(LOG) == pytest.approx(0.1 + 13.816 + 1.0)  # not "still running"
    assert batch_seconds("") == 0.0


def test_metadata_figures_count_characters_as_the_broker_does() -> None:
    figures = metadata_figures(["ba3:" + "\u4e00" * 10, "ba3:x", "ba3:xyz"])
    assert figures == {"commits": 3, "metadata_chars_max": 14, "metadata_chars_median": 7,
                       "metadata_bytes_max": 34}
    assert metadata_figures([])["metadata_chars_max"] == 0


def _result() -> PointResult:
    result = PointResult(Point("partitions", "2", partitions=2), 1000, 67.5, 2)
    for repeat, contender in abba(CONTENDERS, 3):
        rate = {"job": 90.0, "same": 100.0, "large": 400.0}[contender] + repeat
        run = {"contender": contender, "repeat": repeat, "rows_per_s": rate}
        if contender == "job":
            run.update(cpu_s_per_mrows=5.0, cores_used=1.0 + repeat / 10,
                       inserts_per_batch=200, rows_per_block=5.0, metadata_chars_max=900,
                       metadata_bytes_max=1800, parts_per_table_mean=2.0,
                       parts_per_table_max=3, complete=repeat != 2)
        result.runs.append(run)
    return result


def test_summary_is_the_median_of_complete_runs() -> None:
    s = _result().summary()
    assert s["job_rows_per_s"] == 90.5  # repeats 0 and 1; repeat 2 did not store every row
    assert s["same_rows_per_s"] == 101.0 and s["large_rows_per_s"] == 401.0
    assert s["job_over_same"] == pytest.approx(90.5 / 101.0)
    assert s["verdict"].startswith("ok")
    assert s["metadata_chars"] == 900 and s["inserts_per_batch"] == 200


def test_json_round_trip() -> None:
    result = _result()
    text = dump([result], {"command": "python -m bench.bench_curves --rows 1000"})
    back, header = load(text)
    assert header == {"command": "python -m bench.bench_curves --rows 1000"}
    assert back == [result]
    assert back[0].summary() == result.summary()
    assert dump(back, header) == text


def test_widen_makes_every_name_1_kib_and_keeps_the_rest() -> None:
    narrow, wide = Rows(100, 2, 10, 2, 1), widen(Rows(100, 2, 10, 2, 1), 1024)
    assert wide.encoded_row_bytes - narrow.encoded_row_bytes > 1000
    from tests.faults.workload import random_events

    message_type = type(random_events(1, 1)[0])
    for a, b in zip(narrow.pool, wide.pool, strict=True):
        m = message_type.FromString(b.tail)
        assert len(m.name) == 1024 and b.values[4] == m.name
        assert a.values[:4] == b.values[:4] and a.values[5:] == b.values[5:]
    assert len({e.values[4] for e in wide.pool}) == len(wide.pool)  # not one repeated string
    assert widen(narrow, 0) is narrow
    again = widen(Rows(100, 2, 10, 2, 1), 1024)
    assert [e.tail for e in again.pool] == [e.tail for e in wide.pool]  # seeded
    assert CURVES["row_width"] == ("narrow", "1KiB")


def test_the_same_blocks_limit_waits_out_a_pending_quorum() -> None:
    """18.16 refuses a quorum insert while the table's previous one is pending (code
    286); the same-blocks limit sends the block again, as the job does, instead of
    ending the run (which it did at 10 tables, where 8 lanes share a table)."""
    from clickhouse_driver.errors import ServerException

    from bench.bench_limits import insert_waiting_for_quorum

    answers: list[Exception | None] = [ServerException("previous write", code=286),
                                       ServerException("previous write", code=286), None]
    pauses: list[float] = []

    def send() -> None:
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    assert insert_waiting_for_quorum(send, 0.01, pauses.append) == 2
    assert pauses == [0.01, 0.01] and not answers

    def refused() -> None:
        raise ServerException("Table doesn't exist", code=60)

    with pytest.raises(ServerException, match="doesn't exist"):
        insert_waiting_for_quorum(refused, 0.01, pauses.append)


def test_variants_run_between_the_job_and_the_limits() -> None:
    assert contenders() == CONTENDERS
    assert contenders(["c8", "s4"]) == ("job", "job_c8", "job_s4", "same", "large")
    assert contenders(["s4c2"]) == ("job", "job_s4c2", "same", "large")
    assert contenders(["baseline"]) == ("job", "job_baseline", "same", "large")
    assert contenders(["s4c8e8"]) == ("job", "job_s4c8e8", "same", "large")
    assert contenders(["settled"]) == ("job", "job_settled", "same", "large")
    for bad in ("c0", "x8", "c", "s4 ", "8", "base", "c2s4", "s4c0", "e8", "s4e0", "unsettled"):
        with pytest.raises(CurveError, match="unknown variants"):
            contenders([bad])


def test_a_variant_is_summarised_against_the_job_and_the_same_blocks_limit() -> None:
    result = PointResult(Point("tables", "100"), 1000, 67.5, 2)
    rates = {"job": 50.0, "job_c8": 75.0, "same": 100.0, "large": 400.0}
    for repeat, contender in abba(contenders(["c8"]), 2):
        result.runs.append({"contender": contender, "repeat": repeat,
                            "rows_per_s": rates[contender], "cores_used": 0.5})
    s = result.summary()
    assert result.variants() == ["job_c8"]
    assert s["job_c8_rows_per_s"] == 75.0
    assert s["job_c8_over_job"] == 1.5 and s["job_c8_over_same"] == 0.75
    assert "job_c8 75 rows/s = 1.50x the job (0.00x over the batches), 0.75x same" in (
        result.line())
    back, _ = load(dump([result], {}))
    assert back[0].summary() == s


def test_the_warm_tables_limit_runs_after_the_same_blocks_and_is_summarised() -> None:
    assert contenders(["c8"], same_warm=True) == ("job", "job_c8", "same", "same_warm",
                                                  "large")
    result = PointResult(Point("tables", "100"), 1000, 67.5, 2)
    rates = {"job": 60.0, "same": 100.0, "same_warm": 75.0, "large": 400.0}
    for repeat, contender in abba(contenders(same_warm=True), 2):
        result.runs.append({"contender": contender, "repeat": repeat,
                            "rows_per_s": rates[contender], "cores_used": 0.5,
                            "server_cpu_s_per_mrows": 12.0})
    s = result.summary()
    assert s["job_over_same"] == 0.6 and s["job_over_same_warm"] == 0.8
    assert s["same_warm_server_cpu_s_per_mrows"] == 12.0
    assert "same blocks into warm tables 75 rows/s, job/same_warm 0.80" in result.line()
    assert "same_warm_rows_per_s" not in PointResult(Point("tables", "100"), 1000, 67.5,
                                                     2).summary()


def test_a_server_sample_splits_an_interval_by_process_and_event() -> None:
    from bench.bench_limits import ServerSample

    before = ServerSample({"clickhouse-r1": 10.0, "kafka": 5.0},
                          ({"Query": 3, "Merge": 7}, {"Query": 1}))
    after = ServerSample({"clickhouse-r1": 12.5, "kafka": 5.25},
                         ({"Query": 9, "Merge": 7, "InsertQuery": 4}, {"Query": 1}))
    assert after.since(before) == {"cpu_s": {"clickhouse-r1": 2.5, "kafka": 0.25},
                                   "events": {"InsertQuery": 4, "Query": 6},
                                   "events_by_replica": [{"InsertQuery": 4, "Query": 6}, {}]}


def test_the_centre_point_is_on_every_curve_and_own_points_stay() -> None:
    centre = PointResult(Point("tables", "100"), 1000, 67.5, 2)
    own = PointResult(Point("tables", "33", tables=33), 1000, 67.5, 2)
    wide = PointResult(Point("row_width", "1KiB", string_bytes=1024), 1000, 1100.0, 2)
    two = PointResult(Point("partitions", "2", partitions=2), 1000, 67.5, 2)
    results = [centre, own, wide, two]
    assert [r.point.label for r in on_curve(results, "tables")] == ["33", "100"]
    assert [(r.point.curve, r.point.label) for r in on_curve(results, "partitions")] == [
        ("partitions", "2"), ("partitions", "8")]
    assert [r.point.label for r in on_curve(results, "row_width")] == ["narrow", "1KiB"]
    assert [r.point.label for r in on_curve(results, "rows_per_message")] == ["10"]


def test_a_later_run_of_a_point_replaces_an_earlier_one() -> None:
    """Files given in order, older first: a point measured twice is drawn once, from
    the later run; a point of this curve beats the centre borrowed from another."""
    old_33 = PointResult(Point("tables", "33", tables=33), 1000, 67.5, 2)
    new_33 = PointResult(Point("tables", "33", tables=33), 2000, 67.5, 2)
    old_centre = PointResult(Point("tables", "100"), 1000, 67.5, 2)
    new_centre = PointResult(Point("tables", "100"), 2000, 67.5, 2)
    own_narrow = PointResult(Point("row_width", "narrow"), 3000, 67.5, 2)
    results = [old_33, old_centre, new_33, new_centre]
    assert [(r.point.label, r.rows) for r in on_curve(results, "tables")] == [
        ("33", 2000), ("100", 2000)]
    assert [r.rows for r in on_curve(results, "partitions")] == [2000]
    assert [r.rows for r in on_curve([own_narrow, *results], "row_width")] == [3000]


def test_a_variant_sets_slots_lanes_and_the_executors_shared_bound() -> None:
    from bench.bench_e2e import shared_lanes, task_slots, variant

    assert (variant("exactly_once_s4c8e8"), shared_lanes("exactly_once_s4c8e8")) == ((4, 8), 8)
    assert (variant("exactly_once_s4c2"), shared_lanes("exactly_once_s4c2")) == ((4, 2), None)
    assert (task_slots("exactly_once_c4e8", 2), shared_lanes("exactly_once_c4e8")) == (2, 8)


class _Replica:
    """A replica answering ``settle_merges``'s look with the next scripted
    (merges and queued tasks, active parts)."""

    def __init__(self, looks: list[tuple[int, int]]) -> None:
        self.looks = looks

    def execute(self, query: str, params: object) -> list[tuple[int, int]]:
        return [self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]]


def test_the_warm_up_is_settled_once_nothing_merges_and_the_parts_stop_changing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No merge in sight is not enough (a small merge takes milliseconds): the part
    count must also hold still for four looks in a row on every replica."""
    import types

    import bench.bench_e2e as e2e

    looks_made: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: looks_made.append(s))
    first = _Replica([(2, 2400), (0, 900), (0, 300), (0, 40), (0, 40), (0, 40), (0, 40),
                      (0, 40)])
    second = _Replica([(0, 2400), (0, 2400), (1, 500), (0, 40)])
    bench = types.SimpleNamespace(clients=[first, second], database="db")
    e2e.Bench.settle_merges(bench)  # type: ignore[arg-type]
    # parts 40 on both first at look 4; that look is "changed", the next four hold still
    assert len(looks_made) == 8


def test_servers_that_keep_merging_fail_the_run_naming_what_they_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import bench.bench_e2e as e2e

    clock = iter(range(0, 1000, 100))
    monkeypatch.setattr(time, "sleep", lambda s: None)
    monkeypatch.setattr(time, "monotonic", lambda: float(next(clock)))
    bench = types.SimpleNamespace(clients=[_Replica([(3, 70)])], database="db")
    with pytest.raises(RuntimeError, match=r"still merging after 300s \(3 merges and "
                                           r"replication tasks, parts \[70\]\)"):
        e2e.Bench.settle_merges(bench)  # type: ignore[arg-type]
