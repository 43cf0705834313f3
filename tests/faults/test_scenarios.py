"""The fault scenarios: the real job (``spark/job.py``, real Kafka source, metadata
store, ClickHouse block writer, schema registry) on the suite's private stack, a
producer writing a multi-table stream with unique row ids, one fault injected, what
died restarted, then caught up and checked: every delivered row exactly once per table
on both replicas, dead letters exactly once, ``arv verify`` and ``arv audit`` clean.

* ``test_every_kind_once`` (``integration``, so CI runs it): one job, every kind of
  :data:`tests.faults.driver.KINDS` injected once, in order.
* ``test_scenario[kind]`` (``slow``): each kind alone, on its own workload and job.

The long run (``>= 1,000`` faults) is ``python -m tests.faults.driver``
(docs/RELIABILITY.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.faults import driver
from tests.faults.stack import StackControl


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


def _assert_clean(outcome: driver.Outcome, kinds: list[str], job: driver.Job) -> None:
    report = outcome.report
    assert report is not None
    assert report.ok, "\n".join([*report.problems(), "--- job log ---", job.tail(80)])
    assert report.rows_expected > 0 and report.rows_stored == report.rows_expected
    for kind in kinds:
        assert outcome.faults.get(kind, 0) >= 1, f"{kind} was never injected"
    not_fired = [e for e in outcome.events if e.get("fired") is False]
    assert not not_fired, f"faults armed but never triggered: {not_fired}"
    unrecovered = [e for e in outcome.events if e.get("recover_s") is None]
    assert not unrecovered, f"not caught up after: {unrecovered}"


@pytest.mark.integration
@needs_job
def test_every_kind_once(stack: StackControl, tmp_path: Path) -> None:
    kinds = list(driver.KINDS)
    outcome, _, job = driver.run(stack, kinds, faults=len(kinds), messages=4_400, seed=7,
                                 folder=tmp_path, tables=6, partitions=3,
                                 rows_per_message=5, dead_every=53, settle_s=240,
                                 catch_up_s=300)
    _assert_clean(outcome, kinds, job)


@pytest.mark.slow
@needs_job
@pytest.mark.parametrize("kind", driver.KINDS)
def test_scenario(kind: str, stack: StackControl, tmp_path: Path) -> None:
    outcome, _, job = driver.run(stack, [kind], faults=1, messages=2_000, seed=11,
                                 folder=tmp_path, tables=4, partitions=2,
                                 rows_per_message=5, dead_every=41, settle_s=240,
                                 catch_up_s=300)
    _assert_clean(outcome, [kind], job)
