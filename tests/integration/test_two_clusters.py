"""Two Kafka clusters into one shard (issue 27, item 4: eBay's two data centres).

Each data centre has its own Kafka cluster, with the same topic name, and its own job
(own group, checkpoint and schema-registry topic on its own cluster); both jobs write
into the same tables of the shard's two ClickHouse 18.16 replicas. 18.16 recognises a
retried block by the hash of its content, so two clusters' blocks with the same rows at
the same topic name, partition and offsets are one block to it, and the second would
be dropped as a retry: only the ``_incarnation`` column (the writer fills it with
``incarnation_of(cluster id, topic id)``) keeps them apart. The job runs with
``clickhouse.shared_with_other_kafka_clusters = true``, which makes that column
mandatory and lets the second job's first start past the ownership check's stored
rows (they are the other cluster's).

The second cluster is a single KRaft broker started by this module on the stack's
ports + ``SHIFT`` in its own ``BLOCKAGG_STACK_DIR`` (it reuses the shared stack's
Kafka jars), stopped at the end. Token mode (22.2+: the incarnation is in
``insert_deduplication_token``) is covered in-process with chdb
(``tests/unit/clickhouse/test_chdb_semantics.py``).
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts import stack_lib
from tests.integration.conftest import replicated_engine, unique_name
from tests.integration.test_job_clickhouse import (
    COORDINATES,
    PARTITIONS,
    PROTO,
    TABLES,
    ChJob,
    Feed,
    write_config,
)

pytestmark = pytest.mark.integration

SHIFT = 5000
"""Port shift of the second cluster's broker (the fault suite uses 2000)."""
MAX_OFFSETS = 24
"""Both jobs' ``max_offsets_per_trigger``: with the same messages (spread evenly over
the partitions) their batches cover the same ranges, so their blocks are equal but
for ``_incarnation``."""


@pytest.fixture(scope="module")
def second_kafka(tmp_path_factory: pytest.TempPathFactory,
                 stack_env: dict[str, str]) -> Iterator[str]:
    """A second Kafka cluster (one KRaft broker, its own cluster id): its bootstrap."""
    shared = stack_lib.StackConfig.from_env()
    root = tmp_path_factory.mktemp("second-kafka")
    env = {"BLOCKAGG_STACK_DIR": str(root)}
    for var, default in stack_lib.PORT_DEFAULTS.values():
        env[var] = str(default + SHIFT)
    cfg = stack_lib.StackConfig.from_env(env)
    for port in (cfg.ports.kafka, cfg.ports.kafka_controller):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} (stack port + {SHIFT}) is in use: the second "
                            "cluster can't start there", pytrace=False)
    cfg.kafka_lib.parent.mkdir(parents=True, exist_ok=True)
    cfg.kafka_lib.symlink_to(shared.kafka_lib)
    kafka = stack_lib.build_services(cfg)["kafka"]
    kafka.start()
    try:
        kafka.wait_up()
        yield f"127.0.0.1:{cfg.ports.kafka}"
    finally:
        kafka.stop()
        shutil.rmtree(root, ignore_errors=True)


def _create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS,
                                  replication_factor=1)])[topic].result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=10).topics.get(topic)
        if meta is not None and meta.error is None and len(meta.partitions) == PARTITIONS:
            return
        time.sleep(0.2)
    raise AssertionError(f"topic {topic} not ready on {bootstrap}")


def _job(tmp: Path, stack_env: dict[str, str], bootstrap: str, topic: str, database: str,
         clients: list[Any], proto_file: Path) -> ChJob:
    """One data centre's job: its schema registry on its own cluster, its group and
    checkpoint; ``clickhouse.shared_with_other_kafka_clusters = true``."""
    import os

    from click.testing import CliRunner

    from blockagg.registration.cli import cli as ba_schema

    tmp.mkdir()
    env_stack = {**stack_env, "BLOCKAGG_BOOTSTRAP_SERVERS": bootstrap}
    schema_topic = unique_name("_blockagg_schemas_2dc")
    ch = f"{stack_env['BLOCKAGG_CH_HOST']}:{stack_env['BLOCKAGG_CH_PORTS'].split(',')[0]}"
    for short, (_, message) in TABLES.items():
        res = CliRunner().invoke(ba_schema, [
            "--bootstrap-servers", bootstrap, "--topic", schema_topic, "--clickhouse", ch,
            "register", f"{database}.{short}", "--proto", str(proto_file),
            "--message", message])
        assert res.exit_code == 0, f"ba-schema register {short}: {res.output}"
    group = unique_name("it-2dc")
    config = tmp / "blockagg.toml"
    write_config(config, {"group": group, "checkpoint": str(tmp / "checkpoint"),
                          "topic": topic, "host": stack_env["BLOCKAGG_CH_HOST"],
                          "ports": stack_env["BLOCKAGG_CH_PORTS"], "database": database,
                          "bootstrap": bootstrap, "schema_topic": schema_topic}, MAX_OFFSETS, 25)
    text = config.read_text().replace(
        "[clickhouse]\n", "[clickhouse]\nshared_with_other_kafka_clusters = true\n", 1)
    config.write_text(text)
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                "BLOCKAGG_LOG_FORMAT": "text", "SPARK_LOCAL_IP": "127.0.0.1"})
    env.pop("BLOCKAGG_COMPONENTS", None)
    return ChJob(tmp, env_stack, database, topic, group, schema_topic, clients,
                 Feed(bootstrap, topic, database, proto_file), config, tmp / "checkpoint", env)


def _assert_each_cluster_exactly_once(jobs: dict[int, ChJob]) -> dict[int, int]:
    """On both replicas, per table and per incarnation: every id that cluster's feed
    produced exactly once, at its own coordinates, and nothing else."""
    some = next(iter(jobs.values()))
    some.sync()
    counts: dict[int, int] = {}
    for replica, client in enumerate(some.clients):
        for short in TABLES:
            table = f"{some.database}.{short}"
            rows = client.execute(f"SELECT _incarnation, id, _topic, _partition, _offset "
                                  f"FROM {table}")
            assert {int(r[0]) for r in rows} <= set(jobs), (
                f"{table}@r{replica + 1}: rows of an unknown incarnation")
            for incarnation, job in jobs.items():
                mine = [r[1:] for r in rows if int(r[0]) == incarnation]
                want = job.feed.produced.rows[short]
                ids = [int(r[0]) for r in mine]
                assert len(ids) == len(set(ids)) == len(want) and set(ids) == set(want), (
                    f"{table}@r{replica + 1} incarnation {incarnation:x}: {len(ids)} rows, "
                    f"{len(set(ids))} distinct ids, produced {len(want)} "
                    f"(missing {sorted(set(want) - set(ids))[:10]})")
                for i, t, p, o in mine:
                    assert (t, int(p), int(o)) == (job.topic, *want[int(i)])
                if replica == 0:
                    counts[incarnation] = counts.get(incarnation, 0) + len(ids)
    return counts


def test_two_clusters_same_topic_into_one_shard_each_row_once_through_a_kill9(
        tmp_path: Path, stack_env: dict[str, str], second_kafka: str, ch_database: str,
        ch_replicas: list[Any]) -> None:
    """Both clusters' topics start with the same messages (same rows at the same
    partitions and offsets: equal blocks but for ``_incarnation``), then differ. Job A
    is killed (-9) mid-stream; job B then delivers everything, its blocks meeting A's
    equal ones; A restarts and replays its interrupted blocks. Each cluster's rows are
    stored exactly once, on both replicas."""
    from blockagg.aggregator.kafka.incarnation import TopicIncarnations
    from blockagg.rows.deadletters import dead_letter_ddl

    for client in ch_replicas:
        for short, (columns, _) in TABLES.items():
            client.execute(
                f"CREATE TABLE {ch_database}.{short} ({columns}, {COORDINATES}, "
                "_incarnation UInt64 DEFAULT 0) ENGINE = "
                + replicated_engine(ch_database, short, "(_topic, _partition, _offset)"))
        client.execute(dead_letter_ddl(f"{ch_database}.dead_letters"))
    proto_file = tmp_path / "itjob.proto"
    proto_file.write_text(PROTO)
    topic = unique_name("it2dc")
    first = stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    for bootstrap in (first, second_kafka):
        _create_topic(bootstrap, topic)
    a = _job(tmp_path / "a", stack_env, first, topic, ch_database, ch_replicas, proto_file)
    b = _job(tmp_path / "b", stack_env, second_kafka, topic, ch_database, ch_replicas,
             proto_file)
    inc_a = TopicIncarnations({"bootstrap.servers": first}).of(topic)
    inc_b = TopicIncarnations({"bootstrap.servers": second_kafka}).of(topic)
    assert inc_a != inc_b

    # The same envelopes to both (same ids, rows, partitions, offsets), then different
    # ones (B's ids shifted) at the same offsets, then a tail only B has.
    a.feed.good(150)
    b.feed.good(150)
    b.feed.next_id += 1_000_000
    a.feed.good(60)
    b.feed.good(60)
    b.feed.good(30)
    assert a.feed.produced.rows["orders"] != b.feed.produced.rows["orders"]
    same = {k: v for k, v in a.feed.produced.rows["orders"].items()
            if b.feed.produced.rows["orders"].get(k) == v}
    assert len(same) >= 40, "the clusters' first messages must coincide"

    started = time.monotonic()
    running = a.popen()
    try:
        a.wait_rows(1, running)
        running.wait_batches(3)
        running.kill()  # kill -9 of driver and JVM mid-stream
    finally:
        running.kill()
    stored = a.stored_rows()
    assert 0 < stored < a.feed.produced.total_rows, (
        f"job A not killed mid-stream: {stored} of {a.feed.produced.total_rows} rows")
    b.run()  # B's first start: A's rows of the same topic name are not B's
    a.run()  # A's restart after the kill: replays its interrupted blocks
    counts = _assert_each_cluster_exactly_once({inc_a: a, inc_b: b})
    both = sum(int(a.clients[0].execute(
        f"SELECT count() FROM (SELECT _partition, _offset, id FROM {ch_database}.{short} "
        "GROUP BY _partition, _offset, id HAVING uniqExact(_incarnation) = 2)")[0][0])
        for short in TABLES)
    coinciding = sum(len(same_rows) for same_rows in (
        {k: v for k, v in a.feed.produced.rows[t].items()
         if b.feed.produced.rows[t].get(k) == v} for t in TABLES))
    assert both == coinciding > 0, f"{both} rows stored for both clusters, {coinciding} equal"
    assert counts == {inc_a: a.feed.produced.total_rows, inc_b: b.feed.produced.total_rows}
    print(f"\ntwo clusters: {counts[inc_a]} + {counts[inc_b]} rows exact, {coinciding} "
          f"equal rows at equal coordinates stored for each, {time.monotonic() - started:.0f}s")


def test_a_table_without_incarnation_is_refused_when_shared(
        tmp_path: Path, stack_env: dict[str, str], ch_database: str,
        ch_replicas: list[Any], kafka_bootstrap: str) -> None:
    """With ``clickhouse.shared_with_other_kafka_clusters`` the start refuses a table
    that can't carry the cluster's identity on 18.16, in one line naming the table and
    the column to add, before anything is written."""
    import subprocess

    from blockagg.rows.deadletters import dead_letter_ddl

    for client in ch_replicas:
        for short, (columns, _) in TABLES.items():
            marked = "" if short == "clicks" else ", _incarnation UInt64 DEFAULT 0"
            client.execute(
                f"CREATE TABLE {ch_database}.{short} ({columns}, {COORDINATES}{marked}) "
                "ENGINE = " + replicated_engine(ch_database, short,
                                                "(_topic, _partition, _offset)"))
        client.execute(dead_letter_ddl(f"{ch_database}.dead_letters"))
    proto_file = tmp_path / "itjob.proto"
    proto_file.write_text(PROTO)
    topic = unique_name("it2dc")
    _create_topic(kafka_bootstrap, topic)
    job = _job(tmp_path / "a", stack_env, kafka_bootstrap, topic, ch_database, ch_replicas,
               proto_file)
    job.feed.good(6)
    cmd = ["spark-submit", *job.spark_args("local[1]"),
           str(Path(__file__).resolve().parents[2] / "blockagg" / "spark" / "job.py"),
           "--config", str(job.config), "--until-caught-up"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=job.env,
                         check=False)
    out = res.stdout + res.stderr
    table = f"{ch_database}.clicks"
    assert res.returncode != 0, out[-4000:]
    line = next((ln for ln in out.splitlines() if f"table {table} has no _incarnation" in ln),
                None)
    assert line is not None, out[-6000:]
    assert f"ALTER TABLE {table} ADD COLUMN _incarnation UInt64 DEFAULT 0" in line
    assert job.stored_rows() == 0

