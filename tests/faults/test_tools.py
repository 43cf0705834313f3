"""The fault tools against the suite's private stack, without the job: the producer and
checker agree with each other (and catch a duplicate and a loss), a lost insert
acknowledgement leaves the block applied once and its identical retry deduplicated,
kill -9 + ``scripts/stack up`` brings a replica back, and a stopped ZooKeeper makes
ClickHouse refuse replicated inserts with a code the writer retries."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.writer import RETRIABLE_CODES
from tests.faults import checker
from tests.faults.proxy import FaultProxy
from tests.faults.stack import StackControl
from tests.faults.workload import Workload

pytestmark = pytest.mark.integration


@pytest.fixture
def workload(stack: StackControl) -> Iterator[Workload]:
    w = Workload(stack.bootstrap, "127.0.0.1", stack.ch_ports, tables=3, partitions=2,
                 rows_per_message=4, dead_every=5, seed=3)
    w.setup()
    yield w
    w.drop()


def client(port: int, **settings: Any) -> Any:
    from clickhouse_driver import Client

    return Client("127.0.0.1", port=port, connect_timeout=3, send_receive_timeout=30,
                  settings=settings)


def load_expected(w: Workload, ch: Any) -> None:
    """Insert what was produced, as a perfect job would (ids only; other columns default)."""
    for table in w.table_names():
        ids = w.produced.ids_of(table)
        if ids.size:
            ch.execute(f"INSERT INTO {table} (id) VALUES", [[int(i)] for i in ids])
    rows = [[t, p, o, "bad envelope"] for t, p, o in sorted(w.produced.dead)]
    ch.execute(f"INSERT INTO {w.dead_letter_table} (topic, partition, offset, error) VALUES",
               rows)


def test_workload_and_checker_agree(workload: Workload, stack: StackControl) -> None:
    workload.produce(60)
    assert workload.produced.messages == 60
    assert len(workload.produced.dead) == 12  # every 5th
    assert workload.produced.rows == 48 * 4
    all_ids = np.concatenate([workload.produced.ids_of(t) for t in workload.table_names()])
    assert np.unique(all_ids).size == all_ids.size  # unique over the run
    ch = client(stack.ch_ports[0])
    load_expected(workload, ch)
    assert checker.caught_up(workload, timeout=60) is not None
    clients = workload.clients()
    checker.sync_replicas(clients, workload.table_names())
    results = checker.check_tables(workload, clients)
    assert all(r.ok for r in results), results
    # a duplicate (a different block, so not deduplicated) and a foreign row are caught
    table = workload.table_names()[0]
    first = int(workload.produced.ids_of(table)[0])
    ch.execute(f"INSERT INTO {table} (id, name) VALUES", [[first, "again"], [10**12, "x"]])
    checker.sync_replicas(clients, [table])
    bad = [r for r in checker.check_tables(workload, clients) if not r.ok]
    assert {(r.duplicates, r.unexpected) for r in bad} == {(1, 1)} and len(bad) == 2
    report = checker.Report()
    checker.check_dead_letters(workload, clients, report)
    assert report.dead_expected == 12 and report.dead_stored == {0: 12, 1: 12}
    assert not any(report.dead_duplicates.values()) and not any(report.dead_missing.values())


def test_schema_changes_and_the_value_check(workload: Workload, stack: StackControl,
                                            tmp_path: Path) -> None:
    """The ``schema_change`` fault's three changes (a column on every replica + its
    version, a table, a version in another package) are registered through ba-schema
    and switch the producer; rows as a perfect job would store them pass the value
    check, and one wrong value (in a v1 column, or the DEFAULT where the written value
    belongs) is found."""
    import datetime
    import random

    from blockagg.aggregator.kafka.log_store import KafkaStore
    from blockagg.proto.registry import Registry

    rng = random.Random(1)
    workload.produce(20)
    changes = [workload.schema_change(rng, tmp_path, warm=False) for _ in range(3)]
    assert [c["action"] for c in changes] == ["add_column", "new_table", "new_version"]
    workload.produce(40)
    registry = Registry.load(KafkaStore({"bootstrap.servers": workload.bootstrap},
                                        workload.schema_topic))
    assert len(workload.table_names()) == 4
    for change in changes:  # every change is registered (raises otherwise)
        registry.get(change["table"]).version(change.get("version", 1))
    assert workload.changed == {c["table"] for c in changes}
    kinds = ["KIND_UNSPECIFIED", "KIND_VIEW", "KIND_CLICK", "KIND_BUY"]
    ch = client(stack.ch_ports[0], insert_quorum=2)
    clients = workload.clients()
    for table in sorted(workload.changed):
        added = workload.added_since(table)
        columns = ("id, user, delta, price, score, name, country, time, kind, tags"
                   + "".join(f", {a.column}" for a, _ in added))
        rows = []
        for i in workload.produced.ids_of(table).tolist():
            e = workload.events[i % len(workload.events)]
            rows.append([i, e.user, e.delta, e.price, e.score, e.name, e.country,
                         datetime.datetime.fromtimestamp(1_700_000_000 + i % 512, datetime.UTC)
                         .replace(tzinfo=None), kinds[e.kind], list(e.tags),
                         *[a.value(i) if i >= first else a.default for a, first in added]])
        assert rows, f"nothing produced for {table}"
        ch.execute(f"INSERT INTO {table} ({columns}) VALUES", rows)
        checker.sync_replicas(clients, [table])
        assert [checker.check_values(workload, c, table) for c in clients] == [0, 0]
        wrong = list(rows[-1])
        if added:  # the DEFAULT where the version wrote a value
            wrong[0], wrong[-1] = 10**12 + wrong[0], added[-1][0].default
        else:
            wrong[0], wrong[1] = 10**12 + wrong[0], wrong[1] + 1
        ch.execute(f"INSERT INTO {table} ({columns}) VALUES", [wrong])
        checker.sync_replicas(clients, [table])
        assert [checker.check_values(workload, c, table) for c in clients] == [1, 1]


def test_lost_acknowledgement_leaves_one_copy(workload: Workload, stack: StackControl) -> None:
    table = workload.table_names()[0]
    rows = [[i, f"name-{i}"] for i in range(1, 2001)]
    with FaultProxy(stack.ch_ports[0]) as proxy:
        via_proxy = client(proxy.port, insert_quorum=2)
        via_proxy.execute("SELECT 1")  # handshake through the proxy first
        proxy.drop_responses(count=1, min_request_bytes=4096)
        with pytest.raises(Exception):  # noqa: B017 - any client-side error: the ack is lost
            via_proxy.execute(f"INSERT INTO {table} (id, name) VALUES", rows)
        assert proxy.stats.dropped_responses == 1
        direct = client(stack.ch_ports[0])
        assert direct.execute(f"SELECT count() FROM {table}")[0][0] == 2000  # it was applied
        retry = client(proxy.port, insert_quorum=2)
        retry.execute(f"INSERT INTO {table} (id, name) VALUES", rows)  # identical block
        assert direct.execute(f"SELECT count() FROM {table}")[0][0] == 2000  # deduplicated


def test_kill9_and_restart_a_replica(stack: StackControl) -> None:
    pid = stack.kill9("clickhouse-r2")
    assert not stack.is_up("clickhouse-r2")
    stack.up()
    assert stack.is_up("clickhouse-r2") and stack.pid("clickhouse-r2") != pid
    assert client(stack.ch_ports[1]).execute("SELECT 1") == [(1,)]


def test_zookeeper_stopped_refuses_replicated_inserts(workload: Workload,
                                                       stack: StackControl) -> None:
    table = workload.table_names()[1]
    ch = client(stack.ch_ports[0])
    ch.execute(f"INSERT INTO {table} (id) VALUES", [[1]])
    codes: list[int | None] = []

    def insert_while_stopped() -> None:
        try:
            client(stack.ch_ports[0]).execute(f"INSERT INTO {table} (id) VALUES", [[2]])
            codes.append(None)
        except Exception as exc:
            codes.append(getattr(exc, "code", -1))

    with stack.paused("zookeeper"):
        worker = threading.Thread(target=insert_while_stopped, daemon=True)
        worker.start()
        worker.join(timeout=45)
    assert codes and codes[0] is not None, "an insert was acknowledged without ZooKeeper"
    assert codes[0] in RETRIABLE_CODES, f"code {codes[0]} would not be retried by the writer"
    deadline = time.monotonic() + 90
    while True:  # after SIGCONT the replica reconnects; the same insert then succeeds
        try:
            ch.execute(f"INSERT INTO {table} (id) VALUES", [[3]])
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
