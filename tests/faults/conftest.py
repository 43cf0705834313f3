"""Fixtures of the fault suite.

``fault_stack`` (session) brings up the suite's **private** stack (``.stack/faults``,
ports = defaults + 2000; see :mod:`tests.faults.stack`) so that killing its services
never disturbs tests using the default stack, yields its :class:`StackControl`, and
stops it when the session ends, so nothing of the suite outlives the test run.
After each test that used it, every service is brought back up (``scripts/stack up``),
so a scenario that failed half-way never leaves the next one without ZooKeeper.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.stack import StackControl, fault_stack_env


@pytest.fixture(scope="session")
def fault_stack() -> Iterator[StackControl]:
    control = StackControl(fault_stack_env())
    try:
        control.up()
    except RuntimeError as exc:
        pytest.fail(f"the fault suite's private stack did not come up: {exc}")
    yield control
    control.down()


@pytest.fixture
def stack(fault_stack: StackControl) -> Iterator[StackControl]:
    yield fault_stack
    for service in ("zookeeper", "kafka", "clickhouse-r1", "clickhouse-r2"):
        pid = fault_stack.pid(service)
        if pid is not None:
            fault_stack.resume(service, pid)  # never leave a service SIGSTOPped
    fault_stack.up()
