"""Each pytest-xdist worker's default stack (``tests/conftest.py``): its folder and ports,
and that they never meet a stack ``.ci/run`` or the fault suite may start beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import stack_lib
from tests.conftest import REPO, WORKER_PORT_SHIFT, stack_group, worker_stack_env
from tests.faults.stack import CLUSTER_SHIFTS

DEFAULTS = {var: default for var, default in stack_lib.PORT_DEFAULTS.values()}


def test_the_first_worker_and_a_run_without_xdist_keep_the_sessions_stack() -> None:
    assert worker_stack_env({}, None) == {}
    assert worker_stack_env({}, "gw0") == {}
    assert worker_stack_env({}, "master") == {}


def test_a_second_worker_has_its_own_folder_and_ports() -> None:
    env = worker_stack_env({}, "gw1")
    assert env.pop("BLOCKAGG_STACK_DIR") == str(REPO / ".stack" / "gw1")
    assert env == {var: str(port + WORKER_PORT_SHIFT) for var, port in DEFAULTS.items()}


def test_a_moved_session_stack_moves_its_workers_with_it() -> None:
    """``.ci/run`` moved the default stack by 1000 and the workers by 1500."""
    session = {var: str(port + 1000) for var, port in DEFAULTS.items()}
    env = worker_stack_env({**session, "BLOCKAGG_STACK_DIR": "/ci/.stack",
                            "BLOCKAGG_WORKER_PORT_SHIFT": "1500"}, "gw2")
    assert env.pop("BLOCKAGG_STACK_DIR") == str(Path("/ci/.stack/gw2"))
    assert env == {var: str(port + 1000 + 2 * 1500) for var, port in DEFAULTS.items()}


def ports(shift: int) -> set[int]:
    return {port + shift for port in DEFAULTS.values()}


def cluster_ports(shift: int) -> set[int]:
    kafka = DEFAULTS["BLOCKAGG_KAFKA_PORT"] + shift
    return ports(shift) | {kafka + step for step in (2, 3, 4, 5)}


@pytest.mark.parametrize("main", [0, 1000, 5000, 7000])
@pytest.mark.parametrize("worker", [500, 1500, 2500, 3500])
def test_a_workers_ports_never_meet_another_stacks(main: int, worker: int) -> None:
    others = set().union(*(ports(s) for s in (0, 1000, 5000, 7000, 2000, 3000, 6000, 8000)),
                         *(cluster_ports(s) for s in CLUSTER_SHIFTS))
    assert not ports(main + worker) & others


def test_tests_are_grouped_by_the_stack_they_use() -> None:
    assert stack_group("tests/faults/test_x.py::t", ["cluster_fault_stack", "x"], True) \
        == "cluster-stack"
    assert stack_group("tests/faults/test_x.py::t", ["fault_stack"], True) == "fault-stack"
    assert stack_group("tests/integration/test_y.py::t[1]", ["stack_env"], True) \
        == "tests/integration/test_y.py"
    assert stack_group("tests/unit/test_z.py::t", [], False) is None
