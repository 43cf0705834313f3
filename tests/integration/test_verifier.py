"""``arv verify`` against the real broker: histories crafted by committing metadata directly.

Each anomaly kind is caught, and each has a clean twin that is not flagged. The decoder is
checked against the raw records the broker writes to ``__consumer_offsets``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from click.testing import CliRunner, Result
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.aggregator.kafka.offsets_codec import OffsetCommit, decode_record
from blockagg.verifier.cli import cli
from blockagg.verifier.history import OFFSETS_TOPIC, HistoryReader, Tombstone
from blockagg.verifier.rules import Commit

pytestmark = pytest.mark.integration

B = BlockRange
MESSAGES = 400


def md(start: int, end: int, resume: int, *blocks: BlockRange, run: int = 7,
       batch: int = 0) -> Metadata:
    return Metadata(run, batch, start, end, resume, tuple(blocks))


Entry = Metadata | tuple[int, str]


@pytest.fixture
def data_topic(new_topic: Callable[..., str], kafka_bootstrap: str) -> str:
    """A one-partition topic holding ``MESSAGES`` messages (high watermark 400)."""
    topic = new_topic(partitions=1, prefix="arv")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(MESSAGES):
        producer.produce(topic, value=b"m%d" % i, partition=0)
    assert producer.flush(30) == 0
    return topic


def commit_history(bootstrap: str, topic: str, entries: Sequence[Entry]) -> str:
    """Commit ``entries`` in order for a fresh group; returns the group id."""
    group = f"arv-test-{uuid.uuid4().hex[:10]}"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        for entry in entries:
            if isinstance(entry, Metadata):
                offset, text = entry.resume, encode(entry)
            else:
                offset, text = entry
            consumer.commit(offsets=[TopicPartition(topic, 0, offset, metadata=text)],
                            asynchronous=False)
    finally:
        consumer.close()
    return group


def verify(bootstrap: str, group: str, *extra: str) -> tuple[Result, list[dict[str, Any]]]:
    result = CliRunner().invoke(
        cli, ["verify", "--bootstrap-servers", bootstrap, "--group", group, "--json", *extra])
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return result, lines


def check(bootstrap: str, topic: str, entries: Sequence[Entry]) -> tuple[int, list[str]]:
    result, findings = verify(bootstrap, commit_history(bootstrap, topic, entries))
    assert result.exit_code in (0, 1), result.stderr
    return result.exit_code, [f["kind"] for f in findings]


CLEAN = [
    md(100, 200, 100, B(1, 100, 150), B(2, 105, 160)),
    md(100, 200, 105, B(1, 151, 199), B(2, 105, 160)),
    md(100, 200, 200),
    md(200, 300, 200, B(1, 200, 299), B(2, 201, 290), batch=1),
    md(200, 300, 300, batch=1),
]


def test_clean_history(kafka_bootstrap: str, data_topic: str) -> None:
    result, findings = verify(kafka_bootstrap, commit_history(kafka_bootstrap, data_topic, CLEAN))
    assert (result.exit_code, findings) == (0, []), result.stderr
    assert "checked 5 commits of 1 partitions" in result.stderr


def test_backward(kafka_bootstrap: str, data_topic: str) -> None:
    base = md(100, 200, 151, B(1, 151, 199), B(2, 155, 160))
    assert check(kafka_bootstrap, data_topic,
                 [base, md(100, 200, 151, B(1, 151, 199), B(2, 151, 152))]) == (1, ["backward"])
    assert check(kafka_bootstrap, data_topic, [base, base]) == (0, [])


def test_overlap(kafka_bootstrap: str, data_topic: str) -> None:
    base = md(100, 200, 100, B(1, 100, 150))
    assert check(kafka_bootstrap, data_topic,
                 [base, md(100, 200, 100, B(1, 100, 160))]) == (1, ["overlap"])
    replay = md(100, 250, 100, B(1, 100, 150), run=8)
    assert check(kafka_bootstrap, data_topic, [base, replay]) == (0, [])


def test_gap(kafka_bootstrap: str, data_topic: str) -> None:
    final = md(100, 200, 200)
    assert check(kafka_bootstrap, data_topic,
                 [final, md(210, 300, 210, batch=1)]) == (1, ["gap"])
    assert check(kafka_bootstrap, data_topic, [final, md(200, 300, 200, batch=1)]) == (0, [])


def test_offset_mismatch(kafka_bootstrap: str, data_topic: str) -> None:
    m = md(100, 200, 150, B(1, 150, 199))
    assert check(kafka_bootstrap, data_topic, [(160, encode(m))]) == (1, ["offset_mismatch"])
    assert check(kafka_bootstrap, data_topic, [(150, encode(m))]) == (0, [])


def test_undecodable(kafka_bootstrap: str, data_topic: str) -> None:
    final = md(100, 200, 200)
    assert check(kafka_bootstrap, data_topic,
                 [final, (200, "ba1:corrupt~~")]) == (1, ["undecodable"])
    assert check(kafka_bootstrap, data_topic, [final, (200, encode(final))]) == (0, [])


def test_foreign_writer_is_a_notice(kafka_bootstrap: str, data_topic: str) -> None:
    final = md(100, 200, 200)
    group = commit_history(kafka_bootstrap, data_topic, [final, (150, "")])
    result, findings = verify(kafka_bootstrap, group)
    assert result.exit_code == 0, result.stderr
    assert [(f["kind"], f["severity"], f["offset"]) for f in findings] == [
        ("foreign_writer", "notice", 150)]
    strict, _ = verify(kafka_bootstrap, group, "--strict")
    assert strict.exit_code == 1
    twin = commit_history(kafka_bootstrap, data_topic, [final, final])
    assert verify(kafka_bootstrap, twin)[1] == []


def test_reset_past_delivered_offsets_then_resume_is_a_gap(
    kafka_bootstrap: str, data_topic: str
) -> None:
    before = md(100, 200, 150, B(1, 150, 199))
    assert check(kafka_bootstrap, data_topic,
                 [before, (180, ""), md(190, 300, 190, run=9)]) == (1, ["foreign_writer", "gap"])
    assert check(kafka_bootstrap, data_topic,
                 [before, (180, ""), md(180, 300, 180, run=9)]) == (0, ["foreign_writer"])


def test_a_batch_planned_below_a_forward_reset_is_judged_by_its_resume_and_blocks(
    kafka_bootstrap: str, data_topic: str
) -> None:
    """A checkpoint behind a forward reset: the batch starts below the reset's offset
    but resumes and forms blocks from it (accepted); a resume offset below it is a
    rewind (backward)."""
    before = md(100, 200, 150, B(1, 150, 199))
    assert check(kafka_bootstrap, data_topic,
                 [before, (180, ""), md(100, 300, 180, B(1, 180, 260), run=9),
                  md(100, 300, 300, run=9)]) == (0, ["foreign_writer"])
    assert check(kafka_bootstrap, data_topic,
                 [before, (180, ""), md(100, 300, 170, run=9)]) == (
        1, ["foreign_writer", "backward"])


def test_past_end(kafka_bootstrap: str, data_topic: str) -> None:
    assert check(kafka_bootstrap, data_topic,
                 [md(300, 500, 300, B(1, 300, 450))]) == (1, ["past_end"])
    assert check(kafka_bootstrap, data_topic, [md(300, 400, 400)]) == (0, [])


def test_human_table(kafka_bootstrap: str, data_topic: str) -> None:
    group = commit_history(kafka_bootstrap, data_topic,
                           [md(100, 200, 200), md(210, 300, 210, batch=1)])
    result = CliRunner().invoke(
        cli, ["verify", "--bootstrap-servers", kafka_bootstrap, "--group", group])
    assert result.exit_code == 1
    header, row = result.stdout.splitlines()
    assert header.split("\t")[:3] == ["PARTITION", "COMMIT TIME", "ANOMALY"]
    cells = row.split("\t")
    assert cells[0] == f"{group}/{data_topic}[0]"
    assert cells[2] == "gap"
    assert "resume=200" in cells[3] and "[210,300)" in cells[4]
    assert "[200, 210)" in cells[5]


def test_topic_filter_and_unknown_group(kafka_bootstrap: str, data_topic: str) -> None:
    group = commit_history(kafka_bootstrap, data_topic,
                           [md(100, 200, 200), md(210, 300, 210, batch=1)])
    result, findings = verify(kafka_bootstrap, group, "--topic", "some-other-topic")
    assert (result.exit_code, findings) == (2, [])  # --require-commits is the default
    assert "no offset commit of group" in result.stderr
    assert "--no-require-commits" in result.stderr
    result, findings = verify(kafka_bootstrap, group, "--topic", "some-other-topic",
                              "--no-require-commits")
    assert (result.exit_code, findings) == (0, [])
    assert "no offset commit of group" in result.stderr


def test_decoder_on_raw_broker_records(kafka_bootstrap: str, data_topic: str) -> None:
    history: list[Entry] = [
        md(100, 200, 150, B(1, 150, 199)), md(100, 200, 200), (250, "operator")]
    group = commit_history(kafka_bootstrap, data_topic, history)
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "raw-" + group,
                         "enable.auto.commit": False, "enable.partition.eof": True})
    meta = consumer.list_topics(OFFSETS_TOPIC, timeout=10).topics[OFFSETS_TOPIC]
    partitions = sorted(meta.partitions)
    consumer.assign([TopicPartition(OFFSETS_TOPIC, p, OFFSET_BEGINNING) for p in partitions])
    decoded: list[OffsetCommit] = []
    at_end: set[int] = set()
    deadline = time.monotonic() + 30
    while len(at_end) < len(partitions) and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is None:
            continue
        if message.error():
            partition = message.partition()
            assert partition is not None
            at_end.add(partition)
            continue
        record = decode_record(message.key(), message.value())
        if isinstance(record, OffsetCommit) and record.key.group == group:
            decoded.append(record)
    consumer.close()
    expected = [(e.resume, encode(e)) if isinstance(e, Metadata) else e for e in history]
    assert [(r.key.group, r.key.topic, r.key.partition) for r in decoded] == [
        (group, data_topic, 0)] * 3
    assert [(r.value.offset, r.value.metadata.rstrip("\x00")) for r in decoded] == expected
    versions = {r.value.version for r in decoded}
    print(f"value versions written by the broker: {sorted(versions)}")
    assert versions <= {3, 4}
    for r in decoded:
        assert r.value.commit_timestamp > 1_600_000_000_000
        if r.value.version == 4:
            assert r.value.topic_id is not None


def test_tombstone_from_deleted_group(
    kafka_bootstrap: str, kafka_admin: Any, data_topic: str
) -> None:
    group = commit_history(kafka_bootstrap, data_topic, [md(100, 200, 200)])
    for future in kafka_admin.delete_consumer_groups([group], request_timeout=30).values():
        future.result(timeout=30)
    with HistoryReader(kafka_bootstrap, [group]) as reader:
        events = list(reader.events())
    assert [type(e) for e in events] == [Commit, Tombstone]
    assert isinstance(events[1], Tombstone) and events[1].topic == data_topic
    result, findings = verify(kafka_bootstrap, group)
    assert (result.exit_code, findings) == (0, [])
    assert "1 tombstones" in result.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_follow_serves_metrics(kafka_bootstrap: str, data_topic: str) -> None:
    group = commit_history(kafka_bootstrap, data_topic,
                           [md(100, 200, 200), md(210, 300, 210, batch=1)])
    port = _free_port()
    outcome: dict[str, Result] = {}

    def run() -> None:
        outcome["result"] = CliRunner().invoke(cli, [
            "verify", "--bootstrap-servers", kafka_bootstrap, "--group", group, "--json",
            "--follow", "--duration", "8", "--metrics-port", str(port),
            "--metrics-addr", "127.0.0.1"])

    thread = threading.Thread(target=run)
    thread.start()
    body = ""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as rsp:
                body = rsp.read().decode()
            if "blockagg_arv_commits_checked_total 2.0" in body:
                break
        except OSError:
            pass
        time.sleep(0.3)
    late = commit_history(kafka_bootstrap, data_topic, [md(0, 10, 10)])
    del late
    thread.join(30)
    assert "blockagg_arv_commits_checked_total 2.0" in body
    assert 'blockagg_arv_anomalies_total{kind="gap"} 1.0' in body
    assert (f'blockagg_arv_last_commit_timestamp_seconds{{group="{group}",'
            f'partition="0",topic="{data_topic}"}}') in body
    assert "blockagg_arv_lag_records" in body
    result = outcome["result"]
    assert result.exit_code == 1, result.stderr
    assert [json.loads(line)["kind"] for line in result.stdout.splitlines()] == ["gap"]


def test_a_crafted_commit_is_reported_and_the_other_groups_are_checked(
        kafka_bootstrap: str, data_topic: str) -> None:
    """The issue's 31-byte metadata (2**40 blocks of zero-bit fields) in one group: arv
    reports that commit as undecodable, with its group, partition and record, checks the
    other group (whose gap is found too), prints its summary and exits 1."""
    import base64

    import msgpack

    crafted = "ba1:" + base64.b85encode(msgpack.packb(
        [1, 0, 0, 10, 10, b"", [2**40, 0, 0, 0]], use_bin_type=True)).decode()
    bad = commit_history(kafka_bootstrap, data_topic, [md(0, 10, 10), (10, crafted)])
    other = commit_history(kafka_bootstrap, data_topic,
                           [md(100, 200, 200), md(210, 300, 210, batch=1)])
    result = CliRunner().invoke(cli, ["verify", "--bootstrap-servers", kafka_bootstrap,
                                      "--group", bad, "--group", other, "--json"])
    findings = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert result.exit_code == 1, result.stderr
    [undecodable] = [f for f in findings if f["kind"] == "undecodable"]
    assert undecodable["group"] == bad and undecodable["partition"] == 0
    assert undecodable["offset"] == 10 and undecodable["coordinator_offset"] >= 0
    assert "can't hold 1099511627776 blocks" in undecodable["detail"]
    assert [f["group"] for f in findings if f["kind"] == "gap"] == [other]
    assert "checked 4 commits of 2 partitions" in result.stderr
