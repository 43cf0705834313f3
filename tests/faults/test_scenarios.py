"""The fault scenarios: the real job (``spark/job.py``, real Kafka source, metadata
store, ClickHouse block writer, schema registry) on the suite's private stack, a
producer writing a multi-table stream with unique row ids, one fault injected, what
died restarted, then caught up and checked: every delivered row exactly once per table
on both replicas, dead letters exactly once, ``arv verify`` and ``arv audit`` clean.

* ``test_every_kind_once`` (``integration``, so CI runs it): one job, every kind of
  :data:`tests.faults.driver.KINDS` but ``topic_recreate`` injected once, in order.
* ``test_scenario[kind]`` (``slow``): each kind alone, on its own workload and job
  (``topic_recreate`` only here: it stops the job and restarts it from offset 0).
* ``test_every_cluster_kind_once`` (``integration``): on the three-broker stack (RF 3,
  min.insync 2), one job, every kind of :data:`tests.faults.driver.CLUSTER_KINDS` and
  ``broker_kill9`` (a random node) injected once, in order.

The long run (``>= 1,000`` faults) is ``python -m tests.faults.driver``
(docs/RELIABILITY.md).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import driver
from tests.faults.cluster import StandaloneCluster, project_zips
from tests.faults.stack import FAULT_PORT_SHIFT, StackControl


def _job_can_write_clickhouse() -> str | None:
    """The job's default adapters must build the ClickHouse writer; until the data path
    lands there is nothing to inject faults into."""
    try:
        components = importlib.import_module("blockagg.spark.components")
        importlib.import_module("blockagg.aggregator.clickhouse.writer")
    except ImportError as exc:
        return f"the job's adapters do not import: {exc}"
    if not hasattr(components, "make_writer"):
        return ("the job cannot write to ClickHouse yet (spark.components.make_writer is "
                "missing)")
    return None


_MISSING = _job_can_write_clickhouse()
needs_job = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


def _assert_clean(outcome: driver.Outcome, kinds: list[str], job: driver.Job,
                  stack: StackControl | None = None) -> None:
    report = outcome.report
    assert report is not None
    assert report.ok, "\n".join([*report.problems(),
                                 "--- replication ---", stack.replication_report() if stack else "",
                                 "--- job log ---", job.tail(80)])
    assert report.rows_expected > 0 and report.rows_stored == report.rows_expected
    for kind in kinds:
        assert outcome.faults.get(kind, 0) >= 1, f"{kind} was never injected"
    not_fired = [e for e in outcome.events if e.get("fired") is False]
    assert not not_fired, f"faults armed but never triggered: {not_fired}"
    unrecovered = [e for e in outcome.events if e.get("recover_s") is None]
    assert not unrecovered, f"not caught up after: {unrecovered}"
    for event in outcome.events:
        if event["kind"] in ("executor_stall", "alter_during_stall"):
            _assert_fenced(event)
        if event["kind"] == "alter_during_stall":
            _assert_altered_while_stalled(event, report)
        if event["kind"] == "table_added":
            _assert_table_delivered(event, report)
        if event["kind"] == "topic_recreate":
            _assert_recreated(event, outcome)


def _assert_fenced(event: dict[str, Any]) -> None:
    """The stalled attempt outlived its driver, newer attempts committed its partition,
    and once resumed it tried to go on and was refused by the fence."""
    assert event.get("newer_commits"), f"the partition never moved on: {event}"
    assert "AttemptFenced" in event.get("refused", ""), f"the zombie was not refused: {event}"
    assert "newer attempt" in event["refused"]
    assert event.get("zombie_exited"), f"the resumed attempt did not end: {event}"


def _assert_altered_while_stalled(event: dict[str, Any], report: Any) -> None:
    """The attempt stalled after its intent, the table of one of its blocks was ALTERed
    while it was stopped, and that table's values were checked (part of ``report.ok``)."""
    assert event["step"] == "stall_after_commit", event
    altered = event.get("altered") or {}
    assert altered.get("column"), f"nothing was ALTERed while the attempt was stalled: {event}"
    assert any(t.table == altered["table"] and t.wrong == 0 and t.count > 0
               for t in report.tables), f"{altered['table']} was not value-checked: {event}"


def _assert_table_delivered(event: dict[str, Any], report: Any) -> None:
    """The table created while the job ran got rows, each exactly once (``report.ok``)."""
    stored = [t for t in report.tables if t.table == event["table"]]
    assert len(stored) == 2 and all(t.expected > 0 and t.count == t.expected for t in stored), \
        f"the added table {event['table']} was not delivered: {stored}"


def _assert_recreated(event: dict[str, Any], outcome: driver.Outcome) -> None:
    """The procedure ran: the group reset to offset 0 of the new topic on every
    partition; what the old topic had delivered stayed, the rest is its documented loss
    (``report.ok`` holds the job to both, and to every message of the new topic)."""
    assert event.get("reset_to") and set(event["reset_to"].values()) == {0}, event
    assert event["rows_kept"] > 0, f"nothing of the old topic was stored first: {event}"


EVERY_KIND_ONCE = [k for k in driver.KINDS if k not in ("alter_during_stall", "topic_recreate")]
"""The kinds of ``test_every_kind_once`` (CI): all but the two that restart the job
from a stall or from offset 0: ``alter_during_stall`` has its own CI test
(:func:`test_an_alter_while_an_attempt_is_stalled_is_fenced`), ``topic_recreate`` its
scenario (``test_scenario[topic_recreate]``, ``slow``). In the one job of this test,
an ALTER after ``zookeeper_down`` waited minutes for 18.16's replicas (docs/RELIABILITY.md)."""


@pytest.mark.integration
@needs_job
def test_every_kind_once(stack: StackControl, tmp_path: Path) -> None:
    kinds = EVERY_KIND_ONCE
    # 400 messages per fault's share, as with the first ten kinds
    outcome, _, job = driver.run(stack, kinds, faults=len(kinds),
                                 messages=400 * (len(kinds) + 1), seed=7,
                                 folder=tmp_path, tables=6, partitions=3,
                                 rows_per_message=5, dead_every=53, settle_s=240,
                                 catch_up_s=300)
    _assert_clean(outcome, kinds, job, stack)


CLUSTER_PAUSE_S = (10.0, 15.0)
"""``broker_pause`` and ``broker_cut`` in CI: the short end of the long run's 10-60 s."""


@pytest.mark.integration
@needs_job
def test_every_cluster_kind_once(cluster_stack: StackControl, tmp_path: Path) -> None:
    """Issue 27 item 3: each cluster kind once, its target found from the cluster's
    metadata when injected (a data partition's leader, the group's coordinator, a
    partition's transaction coordinator, the KRaft quorum's leader), the operator's
    recovery after each (the node back, every partition's ISR full), and the run exact
    on both shards (one topic per shard, one job)."""
    kinds = [*driver.CLUSTER_KINDS, "broker_kill9"]
    outcome, _, job = driver.run(cluster_stack, kinds, faults=len(kinds),
                                 messages=300 * (len(kinds) + 1), seed=7,
                                 folder=tmp_path, tables=4, partitions=3,
                                 rows_per_message=5, dead_every=53, settle_s=240,
                                 catch_up_s=300, broker_pause_s=CLUSTER_PAUSE_S)
    _assert_clean(outcome, kinds, job, cluster_stack)
    assert outcome.report is not None
    shards = outcome.report.shard_summary()
    assert set(shards) == {"s1", "s2"} and all(
        s["rows_expected"] > 0 and s["rows_stored"] == s["rows_expected"]
        for s in shards.values()), shards
    by_kind = {e["kind"]: e for e in outcome.events}
    nodes = set(cluster_stack.broker_ids)
    for kind in ("leader_kill9", "group_coordinator_kill9", "txn_coordinator_kill9",
                 "controller_kill9", "broker_pause", "broker_cut", "txn_coordinator_cut",
                 "broker_kill9"):
        assert by_kind[kind]["node"] in nodes, by_kind[kind]
    cut = by_kind["txn_coordinator_cut"]
    assert cut["transactional_id"].startswith(f"blockagg.{job.workload.group}."), cut
    assert set(by_kind["rolling_restart"]["node_s"]) == {str(n) for n in nodes}
    moved = by_kind["leader_move"]["leaders"]
    assert all(before != after for before, after in moved.values()), moved
    assert not cluster_stack.out_of_sync()


@pytest.mark.integration
@needs_job
def test_an_alter_while_an_attempt_is_stalled_is_fenced(stack: StackControl,
                                                        tmp_path: Path) -> None:
    """Issue 25, path 1, as the fault kind ``alter_during_stall``: an attempt stalled
    after its intent, newer attempts replayed it, its table ALTERed on both replicas,
    then the attempt resumed: refused before its insert, every row and value exact."""
    outcome, _, job = driver.run(stack, ["alter_during_stall"], faults=1, messages=2_000,
                                 seed=11, folder=tmp_path, tables=4, partitions=2,
                                 rows_per_message=5, dead_every=41, settle_s=240,
                                 catch_up_s=300)
    _assert_clean(outcome, ["alter_during_stall"], job, stack)
    (event,) = outcome.events
    assert "the block was not inserted" in event["refused"], event


@pytest.mark.slow
@needs_job
@pytest.mark.parametrize("kind", driver.KINDS)
def test_scenario(kind: str, stack: StackControl, tmp_path: Path) -> None:
    outcome, _, job = driver.run(stack, [kind], faults=1, messages=2_000, seed=11,
                                 folder=tmp_path, tables=4, partitions=2,
                                 rows_per_message=5, dead_every=41, settle_s=240,
                                 catch_up_s=300)
    _assert_clean(outcome, [kind], job, stack)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StandaloneCluster]:
    """A master and two workers from pyspark's ``bin/spark-class`` on loopback (ports
    7077/8080 + the fault suite's port shift), stopped at the end."""
    shift = int(os.environ.get("BLOCKAGG_FAULT_PORT_SHIFT", FAULT_PORT_SHIFT))
    spark = StandaloneCluster(tmp_path / "cluster", shift=shift)
    spark.folder.mkdir(parents=True)
    spark.start()
    try:
        yield spark
    finally:
        spark.stop()


def _stall_run(stack: StackControl, folder: Path, master: str, seed: int,
               py_files: list[Path] | None = None) -> tuple[driver.Outcome, driver.Job]:
    """One ``executor_stall`` (seed 3 stalls after an intent, so the insert is refused;
    seed 5 before a commit, so the commit is)."""
    outcome, _, job = driver.run(stack, ["executor_stall"], faults=1, messages=1_500, seed=seed,
                                 folder=folder, tables=4, partitions=2, rows_per_message=5,
                                 dead_every=41, settle_s=240, catch_up_s=300, master=master,
                                 py_files=py_files)
    _assert_clean(outcome, ["executor_stall"], job, stack)
    return outcome, job


@pytest.mark.integration
@needs_job
def test_stalled_attempt_is_fenced_local(stack: StackControl, tmp_path: Path) -> None:
    """Issue 13: a task stalled across a driver restart is refused once resumed."""
    outcome, _ = _stall_run(stack, tmp_path, "local[2,4]", seed=3)
    assert outcome.events[0]["step"] == "stall_after_commit"
    assert "the block was not inserted" in outcome.events[0]["refused"]


@pytest.mark.integration
@needs_job
def test_stalled_executor_is_fenced_on_a_standalone_cluster(
        stack: StackControl, cluster: StandaloneCluster, tmp_path: Path) -> None:
    """The same on a real standalone cluster (a master, two workers, the job submitted
    with spark-submit and the project shipped with --py-files): the stalled task ran in
    an executor JVM of a worker, importing blockagg from the shipped zip."""
    outcome, job = _stall_run(stack, tmp_path, cluster.url, seed=5,
                              py_files=project_zips(tmp_path / "zips"))
    (event,) = [e for e in outcome.events if e["kind"] == "executor_stall"]
    assert event["step"] == "stall_before_commit"
    assert "the commit of offset" in event["refused"]  # the producer epoch refused it
    assert ".zip" in str(event.get("blockagg_module")), event
    assert "spark-submit" in " ".join(job.command())


@pytest.mark.integration
@needs_job
def test_a_run_resumed_after_everything_was_killed(stack: StackControl, tmp_path: Path) -> None:
    """The long run outlives its harness (``--resume``): a run stops after 2 faults,
    then the job, the broker, ZooKeeper and both replicas are killed (-9) together, and
    a resumed run rebuilds its workload from the topics, checks (exact) before going on,
    injects only the faults it had not recorded, and ends exact over every message."""
    kinds = ["lost_ack", "task_after_commit", "commit_fails"]
    summary = tmp_path / "run.json"
    common: dict[str, Any] = dict(folder=tmp_path / "job", tables=4, partitions=2,
                                  rows_per_message=5, dead_every=41, settle_s=240,
                                  catch_up_s=300, json_path=summary)
    first, workload, _ = driver.run(stack, kinds, faults=2, messages=1_200, seed=13, **common)
    assert first.report is not None and first.report.ok
    for service in ("clickhouse-r1", "clickhouse-r2", "kafka", "zookeeper"):
        stack.kill9(service)
    stack.up()

    resume = driver.Outcome.load(summary)
    assert resume.run == workload.run and len(resume.events) == 2
    outcome, resumed, job = driver.run(stack, kinds, faults=4, messages=2_400, seed=13,
                                       resume=resume, **common)
    _assert_clean(outcome, kinds, job, stack)
    assert sorted(e["n"] for e in outcome.events) == [0, 1, 2, 3]
    assert outcome.resumes[0]["after_faults"] == 2
    assert outcome.resumes[0]["messages_in_topic"] == workload.produced.messages
    (after_resume,) = [c for c in outcome.interim if c.get("resumed")]
    assert after_resume["ok"] and after_resume["rows_stored"] == workload.produced.rows
    assert resumed.produced.rows > workload.produced.rows
