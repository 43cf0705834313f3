"""Settings for every test process and the JVMs it starts, and how the tests share workers.

``SPARK_SUBMIT_OPTS`` (unless set): the Spark driver JVMs the tests start (about 150,
each living seconds to minutes) run with the client JIT only and the serial
collector. On a 2-core machine the server JIT's compiler threads compete with the job
for the cores; a SparkSession with one small query starts in ~6 s instead of ~8.7 s
(docs/BENCHMARKS.md, *Test JVMs*). Production jobs keep the JVM's defaults: this file
configures tests only.

With pytest-xdist (``-n 2 --dist loadgroup``; CI runs serially, README) each worker has a
default stack of its own: worker ``gw0`` the session's (``scripts/stack``'s defaults or
the ``BLOCKAGG_*`` variables), worker ``gwN`` one under ``<stack dir>/gwN`` with every
port moved by N x ``BLOCKAGG_WORKER_PORT_SHIFT`` (:func:`worker_stack_env`), brought up
by the first test that needs it and stopped when the worker ends. The tests of one
module run in one worker, in order; each private stack of the fault suite
(``fault_stack``, ``cluster_fault_stack``) is a session fixture that one worker starts
and stops, so its tests are one group too. Two workers never share a stack.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
WORKER_PORT_SHIFT = 500
"""The default of ``BLOCKAGG_WORKER_PORT_SHIFT``: half-thousands, so that a worker's
ports never meet the shifts of ``.ci/run`` (the default stack's 0/1000/5000/7000, the
fault suite's 2000/3000/6000/8000) nor the cluster stack's (4000/9000)."""

os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_JVM_OPTIONS)


def worker_stack_env(env: Mapping[str, str], worker: str | None) -> dict[str, str]:
    """The variables that give xdist worker ``gwN`` (N >= 1) a default stack of its
    own: ``BLOCKAGG_STACK_DIR`` = ``<the session's stack dir>/gwN`` and each of
    ``scripts/stack_lib.PORT_DEFAULTS``' ports N x ``BLOCKAGG_WORKER_PORT_SHIFT`` above
    the session's; none for ``gw0`` or outside xdist (the session's stack)."""
    from scripts import stack_lib

    match = re.fullmatch(r"gw(\d+)", worker or "")
    index = int(match.group(1)) if match else 0
    if index == 0:
        return {}
    shift = index * int(env.get("BLOCKAGG_WORKER_PORT_SHIFT") or WORKER_PORT_SHIFT)
    root = Path(env.get("BLOCKAGG_STACK_DIR") or REPO / ".stack")
    moved = {"BLOCKAGG_STACK_DIR": str(root / f"gw{index}")}
    for var, default in stack_lib.PORT_DEFAULTS.values():
        moved[var] = str(int(env.get(var) or default) + shift)
    return moved


WORKER_STACK = worker_stack_env(os.environ, os.environ.get("PYTEST_XDIST_WORKER"))
os.environ.update(WORKER_STACK)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker's own default stack stops with the worker (``.ci/run``'s trap stops
    one a crashed worker left)."""
    if WORKER_STACK and Path(WORKER_STACK["BLOCKAGG_STACK_DIR"]).is_dir():
        subprocess.run([str(REPO / "scripts" / "stack"), "down"], capture_output=True,
                       check=False, timeout=300)


def stack_group(nodeid: str, fixturenames: list[str], integration: bool) -> str | None:
    """A test's xdist group: the private stack it uses, else its module when it uses
    its worker's default stack (``integration``), else ``None`` (any worker, any order)."""
    if "cluster_fault_stack" in fixturenames:
        return "cluster-stack"
    if "fault_stack" in fixturenames:
        return "fault-stack"
    return nodeid.split("::")[0] if integration else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups, before pytest-xdist's own hook reads them (first: a worker registers
    that hook after this file)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = stack_group(item.nodeid, list(getattr(item, "fixturenames", ())),
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
