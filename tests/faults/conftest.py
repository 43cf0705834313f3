"""Fixtures of the fault suite.

``fault_stack`` (session) brings up the suite's **private** stack (``.stack/faults``,
ports = defaults + 2000; see :mod:`tests.faults.stack`) so that killing its services
never disturbs tests using the default stack, yields its :class:`StackControl`, and
stops it when the session ends, so nothing of the suite outlives the test run.
``cluster_fault_stack`` (session) is the three-broker, two-shard stack
(:func:`~tests.faults.stack.cluster_stack_env`: ``.stack/cluster``, ports + 4000) of the
cluster tests and the cluster kinds, started once for both modules (about half a minute
saved) and stopped when the session ends.
After each test that used one, every service of it (every Kafka node of a cluster) is
resumed if stopped, healed if cut, and brought back up (``scripts/stack up``), so a
scenario that failed half-way never leaves the next one without ZooKeeper or a broker.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.stack import StackControl, cluster_stack_env, fault_stack_env


def restore(control: StackControl) -> None:
    """Every service of ``control`` resumed (never left SIGSTOPped), every Kafka node
    back on the network (never left cut), and up."""
    for service in control.services:
        pid = control.pid(service)
        if pid is not None:
            control.resume(service, pid)
    if control.cfg.isolate_brokers:
        for node in control.broker_ids:
            if control.is_cut(node):
                control.heal_broker(node)
    control.up()


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
    restore(fault_stack)


@pytest.fixture(scope="session")
def cluster_fault_stack() -> Iterator[StackControl]:
    try:
        control = StackControl(cluster_stack_env())
        control.up()
    except RuntimeError as exc:
        pytest.fail(f"the three-broker stack did not come up: {exc}")
    yield control
    control.down()


@pytest.fixture
def cluster_stack(cluster_fault_stack: StackControl) -> Iterator[StackControl]:
    yield cluster_fault_stack
    restore(cluster_fault_stack)
