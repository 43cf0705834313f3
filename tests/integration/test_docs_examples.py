"""The docs' runnable examples, run as a new user runs them, against the real stack, so
they stay true.

From ``docs/producing.md``: the row type (the ``proto`` block), the table (the ``sql``
block, on every replica), the commands (the ``sh`` block: create the topic, generate the
Python module, ``ba-schema register``, run the producer) and the producer itself (the
``python`` block, as ``produce_orders.py``). From ``docs/running.md``: the
``spark-submit`` command, with ``--until-caught-up``. From ``docs/schemas.md``: the
dead-letter table's DDL (both statements, on every replica). Then every produced row is
in ClickHouse exactly once, and the producer filled every partition of the topic.

What is substituted, and only that: the stack's addresses for ``127.0.0.1:19092`` and
``127.0.0.1:19000`` (the same unless the stack runs on other ports), a database and a
topic unique to the test for ``shop``, ``orders`` and the dead letters' ``blockagg``,
the repository's ``scripts/stack`` for ``scripts/stack`` (the test runs in its own
folder), the test's Python for ``python``, and the config file.

The docs' other blocks, and the runbooks' inline commands, are run by
``test_docs_runbooks.py``, which also lists every fenced block of README.md and the
three docs with who runs it or why nobody does (output shown in the docs), and fails
on a new block that is neither.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.user_job import REPO, fenced_blocks, shell_commands

pytestmark = pytest.mark.integration

PRODUCING_MD = REPO / "docs" / "producing.md"
RUNNING_MD = REPO / "docs" / "running.md"
SCHEMAS_MD = REPO / "docs" / "schemas.md"


@pytest.fixture
def shop(ch_replicas: list[Any]) -> Iterator[str]:
    database = f"shop_{uuid.uuid4().hex[:10]}"
    yield database
    for client in ch_replicas:
        client.execute(f"DROP DATABASE IF EXISTS {database}")


@pytest.fixture
def dead_letter_db(ch_replicas: list[Any]) -> Iterator[str]:
    """A fresh database for schemas.md's ``blockagg``: its DDL must create it."""
    database = f"dl_{uuid.uuid4().hex[:10]}"
    yield database
    for client in ch_replicas:
        client.execute(f"DROP DATABASE IF EXISTS {database}")


def partitions_with_messages(bootstrap: str, topic: str) -> tuple[int, int]:
    """(partitions of ``topic``, how many hold at least one message)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"docs-{topic}"})
    try:
        count = len(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        highs = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                 for p in range(count)]
    finally:
        consumer.close()
    return count, sum(1 for high in highs if high > 0)


def test_producing_md_producer_and_running_md_spark_submit(
        tmp_path: Path, stack_env: dict[str, str], ch_replicas: list[Any], shop: str,
        dead_letter_db: str) -> None:
    bootstrap = stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    host = stack_env["BLOCKAGG_CH_HOST"]
    ports = stack_env["BLOCKAGG_CH_PORTS"].split(",")
    topic = f"orders_{uuid.uuid4().hex[:10]}"

    def ours(text: str) -> str:
        text = text.replace("127.0.0.1:19092", bootstrap)
        text = text.replace("127.0.0.1:19000", f"{host}:{ports[0]}")
        text = re.sub(r"^scripts/stack\b", str(REPO / "scripts" / "stack"), text, flags=re.M)
        text = re.sub(r"\bshop\.orders\b", f"{shop}.orders", text)
        text = re.sub(r"\bDATABASE IF NOT EXISTS shop\b", f"DATABASE IF NOT EXISTS {shop}", text)
        return re.sub(r"(--topic|" + re.escape(bootstrap) + r") orders\b", rf"\1 {topic}", text)

    row_proto = [b for b in fenced_blocks(PRODUCING_MD, "proto") if "package shop.v1" in b]
    [sql] = fenced_blocks(PRODUCING_MD, "sql")
    [commands] = fenced_blocks(PRODUCING_MD, "sh")
    [producer] = fenced_blocks(PRODUCING_MD, "python")
    (tmp_path / "shop" / "v1").mkdir(parents=True)
    (tmp_path / "shop" / "v1" / "order.proto").write_text(row_proto[0])
    (tmp_path / "produce_orders.py").write_text(ours(producer))

    [dead_letters_sql] = [b for b in fenced_blocks(SCHEMAS_MD, "sql")
                          if "CREATE TABLE blockagg.dead_letters" in b]
    dead_letters_sql = re.sub(r"\bblockagg\b", dead_letter_db, dead_letters_sql)
    for client in ch_replicas:  # the docs: on every replica
        for statement in [*ours(sql).split(";"), *dead_letters_sql.split(";")]:
            if statement.strip():
                client.execute(statement)

    env = {**os.environ, **stack_env,
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{tmp_path}:{REPO}", "BLOCKAGG_LOG_FORMAT": "text"}
    for command in shell_commands(ours(commands)):
        command = re.sub(r"^python\b", sys.executable, command)
        res = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                             capture_output=True, text=True, check=False, timeout=300)
        assert res.returncode == 0, f"{command}: exit {res.returncode}\n{res.stderr[-4000:]}"

    assert partitions_with_messages(bootstrap, topic) == (4, 4)  # an entity key, not one

    config = tmp_path / "blockagg.toml"
    config.write_text(f"""
[job]
metadata_group_id = "docs-{topic}"
checkpoint_location = "{tmp_path / 'checkpoint'}"
trigger_interval = "500ms"

[[topics]]
name = "{topic}"
replicas = [{", ".join(f'"{host}:{p}"' for p in ports)}]

[clickhouse]
database = "{shop}"

[kafka]
"bootstrap.servers" = "{bootstrap}"

[dead_letters]
table = "{dead_letter_db}.dead_letters"

[metrics]
port = 0
""")
    # The first spark-submit of running.md is the run itself (later ones add flags to it).
    submit = next(c for b in fenced_blocks(RUNNING_MD, "sh") for c in shell_commands(b)
                  if c.startswith("spark-submit"))
    submit = submit.replace("--config blockagg.toml", f"--config {config}")
    submit = submit.replace("--conf spark.speculation=false",
                            "--conf spark.speculation=false --conf spark.ui.enabled=false")
    res = subprocess.run(["bash", "-c", f"{submit} --until-caught-up"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=False, timeout=600)
    out = res.stdout + res.stderr
    (tmp_path / "job.log").write_text(out)
    assert res.returncode == 0, f"{submit}: exit {res.returncode}\n{out[-6000:]}"
    assert "blockagg.job: stopped" in out

    for client in ch_replicas:
        client.execute(f"SYSTEM SYNC REPLICA {shop}.orders")
    expected = 100 * 50  # the producer: 100 envelopes of 50 orders, ids 0..4999
    for client in ch_replicas:
        count, unique, low, high = client.execute(
            f"SELECT count(), uniqExact(id), min(id), max(id) FROM {shop}.orders")[0]
        assert (count, unique, low, high) == (expected, expected, 0, expected - 1)
        assert client.execute(f"SELECT count() FROM {dead_letter_db}.dead_letters")[0][0] == 0
