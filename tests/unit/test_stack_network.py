"""The isolated brokers' network on the real kernel (``ip``, as root): who may take over a
bridge that a folder has no record of. CI runs as root; elsewhere the reason is shown."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import stack_lib
from scripts.stack_lib import StackConfig, StackError

PORT = 27992  # a tag no stack of the suite uses: subnet 10.77.24.0/24

pytestmark = pytest.mark.skipif(stack_lib.isolation_problem() is not None,
                                reason=str(stack_lib.isolation_problem()))


def cfg(root: Path) -> StackConfig:
    return StackConfig.from_env({
        "BLOCKAGG_STACK_DIR": str(root), "BLOCKAGG_SPARK_VERSION": "4.0.0",
        "BLOCKAGG_STACK_BROKERS": "3", "BLOCKAGG_STACK_ISOLATE_BROKERS": "1",
        **{var: str(default + PORT - 19092)
           for var, default in stack_lib.PORT_DEFAULTS.values()}})


def links() -> set[str]:
    net = stack_lib.BrokerNetwork.for_stack(PORT, 3)
    names = stack_lib.parse_network_record(net.record())
    return ({b for b in names["bridge"] + names["veth"] if Path("/sys/class/net", b).exists()}
            | {n for n in names["namespace"] if (stack_lib.NETNS_DIR / n).exists()})


@pytest.fixture
def clean() -> Iterator[None]:
    net = stack_lib.BrokerNetwork.for_stack(PORT, 3)
    remove = stack_lib.parse_network_record(net.record())
    stack_lib._remove_links(remove)
    yield
    stack_lib._remove_links(remove)


def test_a_killed_stacks_network_is_taken_over_a_live_or_kept_one_is_not(
        tmp_path: Path, clean: None) -> None:
    first, second = cfg(tmp_path / "first"), cfg(tmp_path / "second")
    stack_lib.ensure_broker_network(first)
    bridge = first.broker_network.bridge
    alias = Path("/sys/class/net", bridge, "ifalias").read_text().strip()
    assert stack_lib.alias_owner(alias) == first.root.resolve()

    with pytest.raises(StackError, match=r"belongs to the stopped stack in .*first"):
        stack_lib.ensure_broker_network(second)

    ns = first.broker_network.namespace(2)
    sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"])
    try:
        (first.root / stack_lib.BROKER_NET_FILE).unlink()  # the first folder re-cloned
        with pytest.raises(StackError, match=rf"in use: pid {sleeper.pid} run in"):
            stack_lib.ensure_broker_network(second)
    finally:
        sleeper.kill()
        sleeper.wait()

    stack_lib.ensure_broker_network(second)  # nothing runs, no record keeps it: taken
    alias = Path("/sys/class/net", bridge, "ifalias").read_text().strip()
    assert stack_lib.alias_owner(alias) == second.root.resolve()
    assert len(links()) == 7

    (first.root / stack_lib.BROKER_NET_FILE).write_text(first.broker_network.record())
    assert stack_lib.teardown_broker_network(first) == []  # the old folder's down: not its
    assert len(links()) == 7
    assert set(stack_lib.teardown_broker_network(second)) == {
        *(f"blockagg-{PORT}-n{n}" for n in (1, 2, 3)),
        *(f"bagg{PORT}n{n}" for n in (1, 2, 3)), f"bagg{PORT}"}
    assert links() == set()
