"""Every fenced block of README.md, docs/producing.md, docs/schemas.md and
docs/running.md is run against the real stack by some test, or listed here with why
not, so a doc that drifts fails CI.

``BLOCKS`` names each block by its document, its language and its first line, and says
who runs it: this module, ``test_docs_examples.py`` (producing.md's example end to end,
running.md's ``spark-submit``, schemas.md's dead-letter DDL), ``test_job_demo.py``
(``scripts/demo``), ``test_stops.py`` (the stop commands), CI itself (the README's test
command), or nobody, as output shown in the docs or with the reason.
``test_every_fenced_block_is_run_or_listed`` fails on a block that is neither, and on a
listed block that is gone.

Run here, extracted from the docs' text, with only the substitutions each test names
(the stack's addresses, names unique to the test, the values a runbook's placeholders
stand for):

* running.md's hanging-transaction runbook, on a transaction the test holds open on a
  group of its own: ``find-hanging``, ``describe-producers``, ``list``, ``describe``,
  the ``kafka-console-consumer`` read of the hanging commit, ``abort``, the re-commit of
  that offset and metadata, then ``kafka-consumer-groups --describe``, its
  ``--reset-offsets ... --to-offset`` and README's ``arv verify`` on the group;
* schemas.md's ``ba-schema`` block (after ``eval "$(scripts/stack env)"``, as written),
  with the evolution steps (``ALTER TABLE ... ADD COLUMN``, the ``system.columns``
  check, ``ba-schema check``, ``register`` of v2) before its ``--version 2`` lines, the
  coordinate and incarnation column fragments as ``ALTER``\\ s, running.md's
  ``DETACH``/``ATTACH``, producing.md's SQL and schemas.md's dead-letter DDL through
  ``clickhouse-client --multiquery`` on each replica, and producing.md's
  ``kafka-topics --describe``;
* running.md's ``--set 'job.dead_letter_missing_blocks=[...]'`` restart: its arguments
  parsed by the job's own option parsing and configuration loader (a start of Spark
  costs ~30 s; the routing itself is tested end to end in ``test_job_safety.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integration.user_job import REPO, shell_commands

pytestmark = pytest.mark.integration

README = REPO / "README.md"
PRODUCING_MD = REPO / "docs" / "producing.md"
SCHEMAS_MD = REPO / "docs" / "schemas.md"
RUNNING_MD = REPO / "docs" / "running.md"
STACK = REPO / "scripts" / "stack"

HERE = "run here"
OUTPUT = "output, not a command"

# (document, language, first line) -> who runs it, or why nobody does.
BLOCKS: dict[tuple[str, str, str], str] = {
    ("README.md", "sh", "# 1. The job end to end on a local stack: installs and starts Kafka "
     "(KRaft), ZooKeeper and two"):
        "test_job_demo.py runs scripts/demo; the pip installs and the pytest command are "
        "what .ci/run runs",
    ("producing.md", "proto", "syntax = \"proto3\";"):
        "the envelope (blockagg/proto/blockagg/v1/envelope.proto, compiled by the package); "
        "the row type's block: test_docs_examples.py",
    ("producing.md", "sql", "CREATE DATABASE IF NOT EXISTS shop;"): HERE,
    ("producing.md", "sh", "scripts/stack kafka-topics --bootstrap-server 127.0.0.1:19092 "
     "--create --topic orders --partitions 4"): "test_docs_examples.py",
    ("producing.md", "python", "import sys"): "test_docs_examples.py",
    ("schemas.md", "sql", "ALTER TABLE shop.orders ADD COLUMN note String DEFAULT 'none';"):
        HERE,
    ("schemas.md", "sh", "eval \"$(scripts/stack env)\"            # "
     "BLOCKAGG_BOOTSTRAP_SERVERS, BLOCKAGG_CH_HOST, ..."): HERE,
    ("schemas.md", "text", "ba-schema: shop.orders: the new version is not BACKWARD "
     "compatible; nothing was registered:"): OUTPUT,
    ("schemas.md", "sql", "_topic String, _partition UInt32, _offset UInt64"): HERE,
    ("schemas.md", "sql", "_incarnation UInt64 DEFAULT 0       -- the dead-letter table: "
     "incarnation UInt64 DEFAULT 0"): HERE,
    ("schemas.md", "sql", "CREATE DATABASE IF NOT EXISTS blockagg;"): HERE,
    ("running.md", "sh", "scripts/demo                 # --messages 20000 --partitions 4 "
     "--rate 0 --bad 0.002"): "test_job_demo.py",
    ("running.md", "sh", "spark-submit \\"): "test_docs_examples.py",
    ("running.md", "", "{\"ts\":\"2026-11-24T03:06:46.021Z\",\"level\":\"INFO\","
     "\"logger\":\"blockagg.job\",\"msg\":\"batch\","): OUTPUT,
    ("running.md", "", "03:06:46 INFO    blockagg.job: batch kind=\"stream\" batch=12 "
     "run=\"1c88…\" partitions=4 messages=20000 rows=100123 bytes=2790000 blocks=12 "
     "replayed_blocks=0 dead_letters=40 skipped=0 commits=8 seconds=1.9 max_task_seconds=1.2 "
     "task_seconds=4.1 commit_seconds=0.3 insert_seconds=5.2 plan_seconds=0.02 "
     "checks_seconds=0.0 ends_seconds=0.01 mark_seconds=0.01 spark_seconds=1.8 "
     "build_seconds=0.03 start_seconds=0.5 last_start_seconds=0.55 submit_seconds=0.15 "
     "launch_seconds=0.05 fresh_workers=0 quorum_waits=3 read_seconds=0.02 "
     "prepare_seconds=1.2"): OUTPUT,
    ("running.md", "", "ERROR blockagg.job: start refused: topic shop.orders is delivered "
     "into shard ch1:9000,ch2:9000 by group 'orders-prod' (since 2026-11-26T10:02:11Z; "
     "orders-prod's committed resume offsets [0]=66011, [1]=65990), not by group "
     "'orders-prd': a second group would store its messages again. Restart with --group "
     "orders-prod (job.metadata_group_id), or take over deliberately from where orders-prod "
     "stopped with --take-over orders-prod (job.take_over_from) once its job is stopped; a "
     "start after what is stored needs --take-over orders-prod too"): OUTPUT,
    ("running.md", "", "Kafka topic orders (data topic): min.insync.replicas=1: acks=all is "
     "acknowledged by a single in-sync replica, whose loss loses the record. Fix: "
     "kafka-configs.sh --bootstrap-server <servers> --alter --entity-type topics "
     "--entity-name orders --add-config min.insync.replicas=2; or accept the risk with "
     "kafka.allow_unsafe_durability = true (--set kafka.allow_unsafe_durability=true)"):
        OUTPUT + " (tests/unit/core/test_kafka_durability.py checks it is the line)",
    ("running.md", "", "metadata for 5001 tables in batch ranges of 1000000 offsets per "
     "partition needs up to 13728 bytes, over the 4095 that offset.metadata.max.bytes = 4096 "
     "allows: set offset.metadata.max.bytes >= 13729 on every broker and "
     "offset_metadata_max_bytes = 13729 in [job], or lower [job] max_offsets_per_trigger"):
        OUTPUT + " (tests/unit/spark/test_preflight_metadata.py checks it is the line)",
    ("running.md", "sql", "DETACH TABLE db.t;"): HERE,
    ("running.md", "sh", "spark-submit ... blockagg/spark/job.py --config blockagg.toml \\"):
        HERE,
    ("running.md", "", "MetadataUnstable: the committed offsets of metadata group 'G' "
     "cannot be read as stable:"): OUTPUT,
    ("running.md", "", 'WARNING blockagg.job: healing a hanging transaction group="G"'):
        OUTPUT + " (test_hanging_heal.py asserts these lines)",
    ("running.md", "sh", "kill -TERM \"$PID\""): "test_stops.py",
    ("running.md", "sh", "pkill -TERM -f \"org.apache.spark.deploy.SparkSubmit.*--config "
     "$CONFIG\""): "test_stops.py",
}


def all_blocks(markdown: Path) -> list[tuple[str, str]]:
    """Every fenced block of ``markdown``: (language, text without its indentation)."""
    found = []
    pattern = r"^([ \t]*)```(\w*)\n(.*?)^\1```"
    for match in re.finditer(pattern, markdown.read_text(), re.M | re.S):
        indent = len(match.group(1))
        found.append((match.group(2), "".join(line[indent:] + "\n"
                                              for line in match.group(3).splitlines())))
    return found


def the_block(markdown: Path, language: str, first_line: str) -> str:
    [block] = [b for lang, b in all_blocks(markdown)
               if lang == language and b.splitlines()[0] == first_line]
    assert BLOCKS[(markdown.name, language, first_line)] == HERE
    return block


def doc_text(markdown: Path) -> str:
    """The prose of ``markdown`` (fenced blocks removed), whitespace collapsed: inline
    commands wrap across lines."""
    text = re.sub(r"^([ \t]*)```.*?^\1```", "", markdown.read_text(), flags=re.M | re.S)
    return " ".join(text.split())


def inline(markdown: Path, command: str) -> str:
    """``command`` as it stands in backticks in ``markdown``'s prose (asserts it does)."""
    assert f"`{command}`" in doc_text(markdown), f"`{command}` is no longer in {markdown.name}"
    return command


def test_every_fenced_block_is_run_or_listed() -> None:
    seen = set()
    for doc in (README, PRODUCING_MD, SCHEMAS_MD, RUNNING_MD):
        for language, block in all_blocks(doc):
            key = (doc.name, language, block.splitlines()[0])
            assert key in BLOCKS, (
                f"{doc.name}: a {language or 'plain'} block starting {key[2]!r} is neither run "
                "by a test nor listed in test_docs_runbooks.BLOCKS with why not")
            seen.add(key)
    assert set(BLOCKS) - seen == set(), "listed blocks no longer in the docs"
    # Blocks another module runs are found there by their text, not by their position.
    for name in ("test_docs_examples.py", "test_job_demo.py", "test_stops.py"):
        assert (REPO / "tests" / "integration" / name).exists()


def run(command: str, env: dict[str, str], cwd: Path = REPO, ok: bool = True,
        timeout: float = 120) -> str:
    res = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                         text=True, check=False, timeout=timeout)
    if ok:
        assert res.returncode == 0, f"{command}: exit {res.returncode}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def table_header(output: str) -> list[str]:
    """The column names of a Kafka tool's table (its first line)."""
    return output.splitlines()[0].split()


# --- running.md: a hanging transaction on the metadata group -------------------------

TOOLS = {"kafka-transactions.sh": "kafka-transactions",
         "kafka-console-consumer.sh": "kafka-console-consumer",
         "kafka-consumer-groups.sh": "kafka-consumer-groups"}


def test_running_md_hanging_transaction_runbook(
        stack_env: dict[str, str], kafka_bootstrap: str,
        new_topic: Callable[..., str]) -> None:
    """The runbook's steps as written, on a transactional offset commit the test holds
    open on its own group: the coordinator still has it ``Ongoing``, so ``find-hanging``
    lists nothing (as the runbook says), and every other step finds it by the values the
    previous steps print."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
    from blockagg.aggregator.kafka.hanging import offsets_partition
    from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore

    topic = new_topic(partitions=1, prefix="runbook")
    group = f"runbook-{uuid.uuid4().hex[:10]}"
    tid = f"blockagg.{group}.{topic}.0"
    env = {**os.environ, **stack_env}
    offsets_topic = Producer({"bootstrap.servers": kafka_bootstrap}).list_topics(
        "__consumer_offsets", timeout=30).topics["__consumer_offsets"]
    where = offsets_partition(group, len(offsets_topic.partitions))
    metadata = encode(Metadata(1, 0, 0, 10, 0, (BlockRange(1, 0, 9),)))

    doc = RUNNING_MD
    find_hanging = inline(doc, "kafka-transactions.sh --bootstrap-server B find-hanging "
                               "--broker-id 1 --max-transaction-timeout 1")
    producers = "kafka-transactions.sh --bootstrap-server B " + inline(
        doc, "describe-producers --topic __consumer_offsets --partition 41")
    listing = inline(doc, "kafka-transactions.sh --bootstrap-server B list")
    describe = "kafka-transactions.sh --bootstrap-server B " + inline(
        doc, "describe --transactional-id <id>")
    abort = inline(doc, "kafka-transactions.sh --bootstrap-server B abort --topic "
                        "__consumer_offsets --partition 41 --start-offset <its start offset>")
    read = inline(doc, "kafka-console-consumer.sh --bootstrap-server B --topic "
                       "__consumer_offsets --partition 41 --offset <start offset> "
                       "--max-messages 1 --formatter "
                       "org.apache.kafka.tools.consumer.OffsetsMessageFormatter")
    reset = inline(doc, "kafka-consumer-groups.sh --reset-offsets ... --to-offset")
    inline(doc, "scripts/stack kafka-consumer-groups")  # the local stack's reset-offsets
    describe_group = "kafka-consumer-groups.sh " + inline(doc, "--describe --group G")
    verify = inline(README, "arv verify --bootstrap-servers … --group …")

    def ours(command: str, start: int | None = None) -> str:
        for tool, local in TOOLS.items():  # running.md: on the local stack, scripts/stack
            command = command.replace(tool, f"{STACK} {local}")
        command = re.sub(r"(--bootstrap-server(s)?) (B|…)", rf"\1 {kafka_bootstrap}", command)
        command = command.replace("--partition 41", f"--partition {where}")
        command = command.replace("<id>", tid).replace("--group G", f"--group {group}")
        command = command.replace("--group …", f"--group {group}")
        if start is not None:
            command = re.sub(r"<(its )?start offset>", str(start), command)
        return command

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid,
                         "transaction.timeout.ms": 300_000})
    store = KafkaMetadataStore({"bootstrap.servers": kafka_bootstrap, "group.id": group},
                               timeout=5.0, retries=1)
    started = time.monotonic()
    try:
        plain = Producer({"bootstrap.servers": kafka_bootstrap})
        for i in range(10):  # the messages the commit's batch [0, 10) covers
            plain.produce(topic, value=b"m%d" % i, partition=0)
        assert plain.flush(30) == 0
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.send_offsets_to_transaction(
            [TopicPartition(topic, 0, 0, metadata=metadata)], store.group_metadata(), 30)

        with ThreadPoolExecutor(3) as pool:  # three independent JVMs at once
            hanging, described, listed = pool.map(
                lambda c: run(ours(c), env), [find_hanging, producers, listing])
        assert tid not in hanging  # the coordinator still has it Ongoing: not hanging yet
        # list names the producer id of the transactional id; describe-producers its
        # transaction's start offset in the group's __consumer_offsets partition
        [listed_row] = [line.split() for line in listed.splitlines() if tid in line.split()]
        producer_id = listed_row[table_header(listed).index("ProducerId")]
        waited = time.monotonic()
        while True:  # the broker's producer state may lag the commit a moment
            rows = [line.split() for line in described.splitlines()
                    if line.split()[:1] == [producer_id]]
            if rows or time.monotonic() - waited > 10:
                break
            time.sleep(1)
            described = run(ours(producers), env)
        assert len(rows) == 1, f"producer {producer_id}:\n{listed}\n{described}"
        header = table_header(described)
        [row] = rows
        start = int(row[header.index("CurrentTransactionStartOffset")])
        assert start >= 0, described

        with ThreadPoolExecutor(2) as pool:
            state, commit = pool.map(lambda c: run(ours(c, start), env), [describe, read])
        assert "Ongoing" in state, state
        assert group in commit and topic in commit, commit

        run(ours(abort, start), env)
        # step 4: commit that same offset and metadata to the group, with a consumer of it
        consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group,
                             "enable.auto.commit": False})
        try:
            consumer.commit(offsets=[TopicPartition(topic, 0, 0, metadata=metadata)],
                            asynchronous=False)
        finally:
            consumer.close()
        last = store.committed(topic, 0)  # stable again: the read no longer waits
        assert last is not None and (last.offset, last.metadata) == (0, metadata)

        verified = run(ours(verify), env)
        assert re.search(r"checked [1-9]\d* commits .*: 0 anomalies", verified), verified
        shown = run(ours(describe_group), env)
        assert any(line.split()[:4] == [group, topic, "0", "0"]
                   for line in shown.splitlines()), shown
        # kafka-consumer-groups.sh --reset-offsets ... --to-offset: "..." is the group,
        # the partition and the mode a reset needs
        run(ours(reset.replace(" ... ", f" --group {group} --topic {topic}:0 ") + " 7 "
                 "--execute"), env)
        shown = run(ours(describe_group), env)
        assert any(line.split()[:4] == [group, topic, "0", "7"]
                   for line in shown.splitlines()), shown
    finally:
        store.close()
        with contextlib.suppress(Exception):  # the runbook aborted its transaction
            producer.abort_transaction(10)
    print(f"runbook: {time.monotonic() - started:.1f} s")


# --- schemas.md's ba-schema block and evolution steps; the SQL through clickhouse-client -


@pytest.fixture
def shop(ch_replicas: list[Any]) -> Iterator[tuple[str, str]]:
    """Databases unique to the test for the docs' ``shop`` and ``blockagg``."""
    names = (f"shop_{uuid.uuid4().hex[:10]}", f"dl_{uuid.uuid4().hex[:10]}")
    yield names
    for client in ch_replicas:
        for name in names:
            client.execute(f"DROP DATABASE IF EXISTS {name}")


def test_schemas_md_ba_schema_block_and_evolution_steps(
        tmp_path: Path, stack_env: dict[str, str], ch_replicas: list[Any],
        shop: tuple[str, str], new_topic: Callable[..., str]) -> None:
    db, dl = shop
    host = stack_env["BLOCKAGG_CH_HOST"]
    ports = stack_env["BLOCKAGG_CH_PORTS"].split(",")
    started = time.monotonic()

    def ours(text: str) -> str:
        text = re.sub(r"\bshop\.(orders|events)\b", rf"{db}.\1", text)
        text = text.replace("DATABASE IF NOT EXISTS shop;", f"DATABASE IF NOT EXISTS {db};")
        text = text.replace("database = 'shop'", f"database = '{db}'")
        text = re.sub(r"\bblockagg\.dead_letters\b", f"{dl}.dead_letters", text)
        text = text.replace("DATABASE IF NOT EXISTS blockagg;", f"DATABASE IF NOT EXISTS {dl};")
        text = text.replace("/blockagg/dead_letters", f"/{dl}/dead_letters")
        return re.sub(r"(?<![\w/])scripts/stack\b", str(STACK), text)

    # No stack addresses in the environment: the block's `eval "$(scripts/stack env)"`
    # must provide them.
    env = {k: v for k, v in os.environ.items() if k not in stack_env or k == "BLOCKAGG_STACK_DIR"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{tmp_path}:{REPO}"

    # producing.md: `clickhouse-client --host … --port …` against each replica;
    # schemas.md: the dead-letter DDL with `clickhouse-client --port 19000 --multiquery`.
    client_cmd = inline(PRODUCING_MD, "clickhouse-client --host … --port …")
    inline(SCHEMAS_MD, "clickhouse-client --port 19000 --multiquery")
    (tmp_path / "orders.sql").write_text(ours(the_block(PRODUCING_MD, "sql",
                                                        "CREATE DATABASE IF NOT EXISTS shop;")))
    (tmp_path / "dead_letters.sql").write_text(ours(the_block(
        SCHEMAS_MD, "sql", "CREATE DATABASE IF NOT EXISTS blockagg;")))
    events = (f"CREATE TABLE {db}.events (id UInt64, name String) ENGINE = "
              f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{db}.events', '{{replica}}') "
              "ORDER BY id")
    for port in ports:
        base = client_cmd.replace("--host …", f"--host {host}").replace("--port …",
                                                                        f"--port {port}")
        run(f"{base} --multiquery < orders.sql", env, cwd=tmp_path)
        run(f"clickhouse-client --host {host} --port {port} --multiquery < dead_letters.sql",
            env, cwd=tmp_path)
        run(f"{base} --query \"{events}\"", env, cwd=tmp_path)

    def sql(statement: str, replica: int = 0) -> list[Any]:
        return list(ch_replicas[replica].execute(statement))

    # schemas.md: the coordinate columns (the ALTER the job's refusal names) on shop.events,
    # the incarnation column on shop.orders and, as its comment says, the dead letters.
    [coordinates] = the_block(SCHEMAS_MD, "sql",
                              "_topic String, _partition UInt32, _offset UInt64").split("\n")[:1]
    sql(f"ALTER TABLE {db}.events " + ", ".join(
        f"ADD COLUMN {c.strip()}" for c in coordinates.split(",")))
    incarnation = the_block(SCHEMAS_MD, "sql", "_incarnation UInt64 DEFAULT 0       -- the "
                            "dead-letter table: incarnation UInt64 DEFAULT 0")
    column, _, dead_letter_column = incarnation.strip().partition("-- the dead-letter table:")
    sql(f"ALTER TABLE {db}.orders ADD COLUMN {column.strip()}")
    sql(f"ALTER TABLE {dl}.dead_letters ADD COLUMN {dead_letter_column.strip()}")

    # the files the block names: producing.md's row type, its descriptor set (the
    # documented protoc command), an ev.proto for shop.events, and v2 with the new field
    order_proto = next(b for lang, b in all_blocks(PRODUCING_MD)
                   if lang == "proto" and "package shop.v1" in b)
    (tmp_path / "shop" / "v1").mkdir(parents=True)
    (tmp_path / "shop" / "v1" / "order.proto").write_text(order_proto)
    protoc = inline(SCHEMAS_MD, "protoc --include_imports --descriptor_set_out=FILE")
    run("python -m grpc_tools." + protoc.replace("FILE", "order.pb") + " -I . shop/v1/order.proto",
        env, cwd=tmp_path)
    (tmp_path / "ev.proto").write_text('syntax = "proto3";\npackage ev.v1;\n'
                                       "message Event { uint64 id = 1; string name = 2; }\n")
    new_field = re.search(r"the row type with the new field \(`([^`]+)`\)",
                          doc_text(SCHEMAS_MD))
    assert new_field, "schemas.md no longer names v2's new field"
    (tmp_path / "order_v2.proto").write_text(
        order_proto.rstrip().removesuffix("}") + f"  {new_field.group(1)}\n}}\n")

    block = ours(the_block(SCHEMAS_MD, "sh", "eval \"$(scripts/stack env)\"            # "
                           "BLOCKAGG_BOOTSTRAP_SERVERS, BLOCKAGG_CH_HOST, ..."))
    commands = shell_commands(block)
    evolve = next(i for i, c in enumerate(commands) if "--version 2" in c)

    def script(lines: list[str]) -> str:
        return "set -e\n" + "\n".join([commands[0], *lines])

    run(script(commands[1:evolve]), env, cwd=tmp_path)

    # schemas.md's evolution steps, before the block's `--version 2` lines presume a v2
    alter = ours(the_block(SCHEMAS_MD, "sql",
                           "ALTER TABLE shop.orders ADD COLUMN note String DEFAULT 'none';"))
    sql(alter.strip().rstrip(";"))  # on one replica: ReplicatedMergeTree replicates it
    columns = ours(inline(SCHEMAS_MD, "SELECT name FROM system.columns WHERE database = "
                                      "'shop' AND table = 'orders'"))
    for replica in range(len(ch_replicas)):
        assert ("note",) in sql(columns, replica)
    steps = [ours(inline(SCHEMAS_MD, "ba-schema check shop.orders")),
             ours(inline(SCHEMAS_MD, "ba-schema register shop.orders --proto order_v2.proto "
                                     "--message shop.v1.Order"))]
    run(script(steps), env, cwd=tmp_path)
    out = run(script(commands[evolve:]), env, cwd=tmp_path)
    assert "FULL" in out, out

    # running.md's DETACH/ATTACH remedy, on a replica, through clickhouse-client
    remedy = the_block(RUNNING_MD, "sql", "DETACH TABLE db.t;").replace("db.t", f"{db}.orders")
    run(f"clickhouse-client --host {host} --port {ports[-1]} --multiquery --query "
        f"{shlex.quote(remedy)}", env)
    assert ("note",) in sql(columns, len(ch_replicas) - 1)

    # producing.md: `scripts/stack kafka-topics --describe --topic orders`: four partitions
    topic = new_topic(partitions=4, prefix="orders")
    described = run(ours(inline(PRODUCING_MD, "scripts/stack kafka-topics --describe --topic "
                                              "orders")).replace("orders", topic), env)
    assert described.count("Partition: ") == 4, described
    print(f"ba-schema block: {time.monotonic() - started:.1f} s")


def test_running_md_dead_letter_missing_blocks_restart_parses(tmp_path: Path) -> None:
    """The restart command's flags, after ``job.py``, through the job's own parsing:
    the ``--set`` value is TOML, quoted for the shell as written."""
    from blockagg.config import load
    from blockagg.spark.job import _toml_value

    block = the_block(RUNNING_MD, "sh",
                      "spark-submit ... blockagg/spark/job.py --config blockagg.toml \\")
    [command] = shell_commands(block)
    args = shlex.split(command)
    args = args[args.index("blockagg/spark/job.py") + 1:]
    assert args[:2] == ["--config", "blockagg.toml"]
    [value] = [v for flag, v in itertools.pairwise(args) if flag == "--set"]
    key, _, text = value.partition("=")
    toml = tmp_path / "blockagg.toml"
    toml.write_text('[job]\nmetadata_group_id = "g"\ncheckpoint_location = "/tmp/c"\n'
                    '[kafka]\n"bootstrap.servers" = "127.0.0.1:19092"\n'
                    '[[topics]]\nname = "events"\nreplicas = ["127.0.0.1:19000"]\n')
    config = load(str(toml), {key: _toml_value(text)})
    [missing] = config.job.dead_letter_missing_blocks
    assert "events" in str(missing) and "120400" in str(missing), missing
