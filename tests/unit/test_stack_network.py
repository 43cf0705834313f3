"""The isolated brokers' network on the real kernel (``ip``, as root): who may take over a
bridge that a folder has no record of. CI runs as root; elsewhere the reason is shown."""

from __future__ import annotations

import subprocess
import sys
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

    net, node = first.broker_network, first.kafka_brokers[1]
    listen = ("import socket, sys, time; s = socket.socket(); "
              f"s.bind(({node.host!r}, {node.port})); s.listen(); print(1, flush=True); "
              "time.sleep(60)")
    node_2 = subprocess.Popen(["ip", "netns", "exec", net.namespace(2), sys.executable, "-c",
                               listen], stdout=subprocess.PIPE, text=True)
    try:
        assert node_2.stdout is not None and node_2.stdout.readline() == "1\n"
        assert stack_lib.answering_nodes(net, first.ports.kafka) == [f"{node.host}:{node.port}"]
        (first.root / stack_lib.BROKER_NET_FILE).unlink()  # the first folder re-cloned
        with pytest.raises(StackError, match=rf"in use by .*first \(pid {node_2.pid}\)"):
            stack_lib.ensure_broker_network(second)
    finally:
        node_2.kill()
        node_2.wait()
    assert stack_lib.network_in_use(net, first.ports.kafka) == []

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
