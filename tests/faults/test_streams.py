"""tests.faults.driver's fault plan and overlapping streams (no stack).

The long run keeps several faults in flight (``--streams``); these tests pin what makes
that safe and reproducible: the plan is a pure function of kinds, count and seed; two
faults on one resource never overlap; every planned fault runs exactly once; an error
in one stream stops the others and reaches the caller.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest

from tests.faults import driver


def test_plan_is_each_kind_once_then_seeded_draws() -> None:
    kinds = list(driver.KINDS)
    first = driver.plan(kinds, 200, seed=5)
    assert first[: len(kinds)] == kinds
    assert first == driver.plan(kinds, 200, seed=5)
    assert first != driver.plan(kinds, 200, seed=6)
    assert set(first[len(kinds):]) == set(kinds)


def test_every_kind_has_a_resource() -> None:
    assert set(driver._RESOURCE) == set(driver.KINDS + driver.CLUSTER_KINDS)
    assert all(driver._RESOURCE[k] for k in driver.KINDS + driver.CLUSTER_KINDS)
    # a cluster kind restarts or stops a broker: never beside broker_kill9 or another
    assert all(driver._RESOURCE[k] == ("kafka",) for k in driver.CLUSTER_KINDS)


def test_leader_move_prefers_a_replica_other_than_the_leader() -> None:
    from tests.faults.stack import _rotated_away

    for replicas in ([1, 2, 3], [3, 1, 2], [2, 3, 1]):
        for leader in replicas:
            moved = _rotated_away(replicas, leader)
            assert sorted(moved) == sorted(replicas) and moved[0] != leader, (replicas, leader)


def test_cluster_kinds_are_drawn_only_on_three_brokers(capsys: Any) -> None:
    """The cluster kinds are refused on a single broker, before any stack is touched: by
    the CLI (``--kinds`` without ``--brokers 3``) and by :func:`driver.run`; with
    ``--brokers 3`` and no ``--kinds`` they join the single-broker list."""
    from pathlib import Path

    from tests.faults.stack import StackControl, fault_stack_env

    assert not set(driver.KINDS) & set(driver.CLUSTER_KINDS)
    with pytest.raises(SystemExit):
        driver.main(["--kinds", "leader_kill9,driver_kill9"])
    assert "cluster kinds need --brokers 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        driver.main(["--brokers", "3", "--kinds", "leader_kil9"])
    assert "unknown ['leader_kil9']" in capsys.readouterr().err
    single = StackControl(fault_stack_env())
    with pytest.raises(ValueError, match="rolling_restart need a three-broker stack"):
        driver.run(single, ["driver_kill9", "rolling_restart"], faults=2, messages=10,
                   seed=1, folder=Path("/nonexistent"))


def test_a_weighted_kind_is_drawn_by_its_weight_and_unweighted_plans_are_unchanged() -> None:
    """``topic_recreate`` (weight 1/4) is drawn about a quarter as often as the others;
    a plan of kinds without weights draws exactly as before weights existed."""
    kinds = list(driver.KINDS)
    drawn = Counter(driver.plan(kinds, 20_000, seed=3)[len(kinds):])
    per_other = (sum(drawn.values()) - drawn["topic_recreate"]) / (len(kinds) - 1)
    assert 0.2 < drawn["topic_recreate"] / per_other < 0.3
    old = ["driver_kill9", "lost_ack", "schema_change"]
    rng = random.Random(9)
    assert driver.plan(old, 50, seed=9) == [old[n] if n < 3 else rng.choice(old)
                                            for n in range(50)]


class _Recorder(driver._Run):
    """A run whose faults only sleep, recording which resources were busy at once."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.resources = {r: threading.Lock() for r in driver.resources()}
        self.busy: Counter[str] = Counter()
        self.max_busy: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.ran: list[int] = []
        self.fail_at = fail_at
        self.guard = threading.Lock()

    def fault(self, n: int, kind: str) -> dict[str, Any]:
        held = sorted(driver._RESOURCE[kind])
        with contextlib.ExitStack() as stack:
            for resource in held:
                stack.enter_context(self.resources[resource])
            with self.guard:
                for resource in held:
                    self.busy[resource] += 1
                    self.max_busy[resource] = max(self.max_busy[resource],
                                                  self.busy[resource])
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            time.sleep(0.002)
            with self.guard:
                for resource in held:
                    self.busy[resource] -= 1
                self.in_flight -= 1
                self.ran.append(n)
        if n == self.fail_at:
            raise RuntimeError(f"fault {n} failed")
        return {"n": n, "kind": kind}


@pytest.mark.parametrize("streams", [1, 4])
def test_streams_run_each_fault_once_never_two_on_one_resource(streams: int) -> None:
    run = _Recorder()
    faults = list(enumerate(driver.plan(list(driver.KINDS), 120, seed=1)))
    run.phase(faults, streams)
    assert sorted(run.ran) == list(range(120))
    assert max(run.max_busy.values()) == 1
    assert run.max_in_flight <= streams
    if streams > 1:
        assert run.max_in_flight > 1


def test_an_error_in_one_stream_stops_the_others_and_is_raised() -> None:
    run = _Recorder(fail_at=7)
    faults = list(enumerate(driver.plan(list(driver.KINDS), 500, seed=1)))
    with pytest.raises(RuntimeError, match="fault 7 failed"):
        run.phase(faults, 3)
    assert len(run.ran) < 500


def test_the_cuts_are_refused_on_a_stack_whose_brokers_are_not_isolated() -> None:
    """``broker_cut`` and ``txn_coordinator_cut`` need the nodes in network namespaces
    (``--isolate-brokers``): on a three-broker stack on loopback :func:`driver.run`
    refuses them in one line naming why, before any stack is touched (never a silent
    skip)."""
    from pathlib import Path

    from tests.faults.stack import StackControl, fault_stack_env

    loopback = StackControl(fault_stack_env(brokers=3, isolate_brokers=False))
    assert loopback.cut_unavailable() is not None
    with pytest.raises(ValueError, match=r"broker_cut refused before the run: its Kafka "
                                         r"nodes are not isolated .*--isolate-brokers"):
        driver.run(loopback, ["broker_pause", "broker_cut"], faults=2, messages=10, seed=1,
                   folder=Path("/nonexistent"))
    with pytest.raises(ValueError, match=r"^broker_cut and txn_coordinator_cut refused "
                                         r"before the run: .*drop them from the kinds"):
        driver.run(loopback, ["txn_coordinator_cut", "broker_cut"], faults=2, messages=10,
                   seed=1, folder=Path("/nonexistent"))
    with pytest.raises(ValueError, match=r"^txn_coordinator_cut refused before the run"):
        driver.run(loopback, ["txn_coordinator_cut"], faults=1, messages=10, seed=1,
                   folder=Path("/nonexistent"))
    isolated = StackControl(fault_stack_env(brokers=3, isolate_brokers=True))
    assert isolated.cut_unavailable() is None
    assert isolated.broker_address(2).startswith("10.77.")
