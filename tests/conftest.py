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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = stack_group(list(getattr(item, "fixturenames", ())),
                            item.get_closest_marker("integration") is not None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
