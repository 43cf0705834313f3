"""``lost_ack`` fires whichever replica the writer is on and whether or not traffic is
flowing when it is armed (no stack: real fault proxies before a loopback server).

The grader's CI run of 2026-11-27 recorded ``lost_ack`` as armed but never fired: only
the shard's first replica was armed, and nothing guaranteed a block of 2 KiB or more
reached it within the window (the writer stays on the replica it failed over to, and a
caught-up job inserts nothing)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.faults import driver
from tests.faults.proxy import FaultProxy, Mode
from tests.faults.test_proxy import Server, request


@dataclass
class _Job:
    shard_proxies: list[list[FaultProxy]]


@pytest.fixture
def replicas() -> Iterator[tuple[Server, list[FaultProxy]]]:
    server = Server()
    proxies = [FaultProxy(server.port), FaultProxy(server.port)]
    yield server, proxies
    for proxy in proxies:
        proxy.close()
    server.stop = True
    server.sock.close()


def _block(port: int) -> None:
    """A block insert: more than the 2 KiB that tells it from a query."""
    with pytest.raises(OSError):
        request(port, b"b" * 5000)


def test_the_replica_the_writer_failed_over_to_loses_the_ack(
        replicas: tuple[Server, list[FaultProxy]]) -> None:
    server, proxies = replicas
    job = _Job([proxies])
    writer = threading.Timer(0.3, _block, args=(proxies[1].port,))
    writer.start()
    info = driver.lose_an_ack(job, random.Random(1), produce=None, window_s=5)  # type: ignore[arg-type]
    writer.join()
    assert info == {"fired": True, "replica": [2]}
    assert server.received == [b"b" * 5000]  # applied once, its answer lost
    assert all(p.mode is Mode.FORWARD for p in proxies)  # the other replica disarmed
    assert request(proxies[0].port, b"c" * 5000).startswith(b"ok:")


def test_a_caught_up_job_is_given_blocks_until_one_loses_its_ack(
        replicas: tuple[Server, list[FaultProxy]]) -> None:
    _, proxies = replicas
    job = _Job([proxies])
    produced: list[int] = []

    def produce(n: int) -> None:
        produced.append(n)
        if len(produced) == 2:  # the first burst makes only small blocks
            _block(proxies[0].port)
        else:
            assert request(proxies[0].port, b"s" * 100) == b"ok:" + b"s" * 20 + b"\n"

    info = driver.lose_an_ack(job, random.Random(1), produce, window_s=10,  # type: ignore[arg-type]
                              burst_every_s=0.2)
    assert info == {"fired": True, "replica": [1], "extra_messages": 2 * driver.LOST_ACK_BURST}
    assert produced == [driver.LOST_ACK_BURST] * 2


def test_no_block_in_the_window_is_recorded_as_not_fired(
        replicas: tuple[Server, list[FaultProxy]]) -> None:
    _, proxies = replicas
    info = driver.lose_an_ack(_Job([proxies]), random.Random(1), produce=None,  # type: ignore[arg-type]
                              window_s=0.5)
    assert info == {"fired": False}
    assert all(p.mode is Mode.FORWARD for p in proxies)
    with socket.create_connection(("127.0.0.1", proxies[1].port), timeout=2):
        pass
