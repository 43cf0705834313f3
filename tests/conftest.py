"""Settings for every test process and the JVMs it starts, and how the tests share workers.

``SPARK_SUBMIT_OPTS`` (unless set): the Spark driver JVMs the tests start (about 150,
each living seconds to minutes) run with the client JIT only and the serial
collector. On a 2-core machine the server JIT's compiler threads compete with the job
for the cores; a SparkSession with one small query starts in ~6 s instead of ~8.7 s
(docs/BENCHMARKS.md, *Test JVMs*). Production jobs keep the JVM's defaults: this file
configures tests only.

With pytest-xdist (``-n 2 --dist loadgroup``, the README's command), every test that
uses one stack runs in one worker, in collection order: the tests of the default stack
(``integration``) stop and restart its services and rely on their order, and each
private stack of the fault suite (``fault_stack``, ``cluster_fault_stack``) is a session
fixture that one worker starts and stops. Two workers never share a stack; the
suites overlap each other's waits (broker pauses, session timeouts, catch-up polls).
Tests of no stack go to whichever worker is free.
"""

from __future__ import annotations

import os

import pytest

TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_JVM_OPTIONS)


def stack_group(fixturenames: list[str], integration: bool) -> str | None:
    """The stack a test uses, as its xdist group: ``None`` for a test of no stack."""
    if "cluster_fault_stack" in fixturenames:
        return "cluster-stack"
    if "fault_stack" in fixturenames:
        return "fault-stack"
    return "stack" if integration else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups, before pytest-xdist's own hook reads them (first: a worker registers
    that hook after this file)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = stack_group(list(getattr(item, "fixturenames", ())),
                            item.get_closest_marker("integration") is not None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """On a worker: a test whose group pytest-xdist could not mark in its id (pytest
    9.2 no longer lets it, pytest-xdist#1386; hence ``pytest<9.2`` in the ``dev``
    extra) may run beside another test of its stack; it fails at setup instead, before
    any fixture touches the stack."""
    config = session.config
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[UNGROUPED] = (
                f"pytest-xdist did not keep this test in its stack's worker: pytest "
                f"{pytest.__version__} does not let it mark the group; install the dev "
                "extra's pytest (pip install -e '.[dev]') or run with -n 0")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = item.stash.get(UNGROUPED, None)
    if reason is not None:
        pytest.fail(reason, pytrace=False)
