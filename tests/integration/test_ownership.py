"""One group per topic and shard (issue 26 item 1), on the real stack with
``spark-submit``: the operator's trial (deliver a topic with group A, start group B
with a fresh checkpoint) is refused before Spark starts, in one line, and nothing is
written twice; the owner's restart and a deliberate take-over go on; a shard that
stores a topic's rows without any ownership record (delivered before records
existed) refuses a new group too; two claims at once cannot both win; ``arv verify``
and ``arv audit`` report a group delivering a topic another group owns.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from blockagg.aggregator.kafka.exceptions import TopicOwned
from blockagg.aggregator.kafka.ownership import ClaimKey, OwnersStore, shard_identity
from blockagg.config import load
from blockagg.spark import ownership
from blockagg.verifier.cli import cli as arv
from tests.integration.test_startup_refusals import refused
from tests.integration.user_job import Job

pytestmark = pytest.mark.integration


@pytest.fixture
def job(tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str],
        ch_database: str, ch_replicas: list[Any]) -> Iterator[Job]:
    user = Job(tmp_path, stack_env, ch_database, new_topic(partitions=2, prefix="own"),
               ch_replicas)
    user.create_tables()
    user.produce(40)
    yield user


def _owners_topic() -> str:
    return f"_own_owners_{uuid.uuid4().hex[:8]}"


def _config(job: Job, owners: str, name: str = "blockagg.toml", extra: str = "",
            checkpoint: str = "checkpoint") -> Path:
    return job.config(name, job=f'owners_topic = "{owners}"\n{extra}', checkpoint=checkpoint)


def _committed(job: Job, group: str) -> dict[int, int]:
    saved, job.group = job.group, group
    try:
        return job.committed()
    finally:
        job.group = saved


def _record(job: Job, owners: str) -> Any:
    store = OwnersStore({"bootstrap.servers": job.bootstrap}, owners)
    key = ClaimKey(store.cluster_id(), job.topic, shard_identity(job.replicas))
    return store.read().get(key)


def _delivered(job: Job, config: Path, *flags: str) -> None:
    run = job.run(config, "--until-caught-up", *flags)
    assert run.code == 0, run.out[-6000:]
    print("\n".join(line for line in run.out.splitlines()
                    if "ownership:" in line or "start-up checks passed" in line))


def test_a_second_group_is_refused_at_start_and_writes_nothing(job: Job) -> None:
    """The trial: group A delivers; group B with a fresh checkpoint is refused in one
    line naming A, what A delivered and the ways on; 0 rows written twice; A restarts
    (fresh checkpoint too) and goes on exactly once."""
    owners = _owners_topic()
    group_a = job.group
    _delivered(job, _config(job, owners))
    job.assert_exactly_once()
    delivered = _committed(job, group_a)
    assert sum(delivered.values()) == 40
    assert _record(job, owners).owner == group_a

    group_b = f"{group_a}-b"
    run = job.run(_config(job, owners, "b.toml", checkpoint="fresh-b"), "--group", group_b)
    # Keyless messages land where librdkafka's sticky partitioner puts them: all 40 in
    # one partition now and then, and a partition without messages has no commit.
    line = refused(run, f"by group '{group_a}'", f"not by group '{group_b}'",
                   f"--group {group_a}", f"--take-over {group_a}",
                   *(f"[{p}]={offset}" for p, offset in sorted(delivered.items())), job.topic)
    assert "store its messages again" in line
    assert _committed(job, group_b) == {}
    job.assert_exactly_once()  # 40 rows, each once: nothing written twice

    job.produce(10)
    _delivered(job, _config(job, owners, "a2.toml", checkpoint="fresh-a"))
    job.assert_exactly_once()
    assert _record(job, owners).owner == group_a  # the owner's restart wrote nothing
    assert len(_record(job, owners).history) == 1


def test_a_deliberate_take_over_continues_where_the_owner_stopped(job: Job) -> None:
    """--take-over A: B gets A's commits (in the ownership record's transaction), the
    record says who took over, from which group and offsets; B delivers the rest
    exactly once; A is then refused, naming B; arv on A and B is clean."""
    owners = _owners_topic()
    group_a = job.group
    _delivered(job, _config(job, owners))
    delivered = _committed(job, group_a)

    group_b = f"{group_a}-b"
    job.produce(15)
    config_b = _config(job, owners, "b.toml", checkpoint="fresh-b")
    _delivered(job, config_b, "--group", group_b, "--take-over", group_a)
    job.assert_exactly_once()
    record = _record(job, owners)
    assert record.owner == group_b
    last = record.history[-1]
    assert (last.group, last.from_group, dict(last.offsets)) == (group_b, group_a, delivered)
    assert sum(_committed(job, group_b).values()) == 55

    # the take-over flag kept in the configuration: the owner's restart, nothing rewritten
    job.produce(5)
    _delivered(job, config_b, "--group", group_b, "--take-over", group_a)
    job.assert_exactly_once()
    assert len(_record(job, owners).history) == 2

    run = job.run(_config(job, owners, "a2.toml", checkpoint="fresh-a"))
    refused(run, f"by group '{group_b}'", f"not by group '{group_a}'", f"--group {group_b}")
    job.assert_exactly_once()

    for group in (group_a, group_b):
        res = CliRunner().invoke(arv, ["verify", "--bootstrap-servers", job.bootstrap,
                                       "--group", group, "--topic", job.topic,
                                       "--owners-topic", owners])
        assert res.exit_code == 0, res.stdout + res.stderr


def test_rows_stored_without_a_record_refuse_a_new_group(job: Job) -> None:
    """A group that delivered before ownership was recorded (its record deleted here):
    a new group would deliver offsets the shard already stores; refused naming the
    partitions, the highest stored offsets and the way to start after them. The group
    that delivered them then claims the topic and goes on exactly once."""
    owners = _owners_topic()
    _delivered(job, _config(job, owners))
    store = OwnersStore({"bootstrap.servers": job.bootstrap}, owners)
    key = ClaimKey(store.cluster_id(), job.topic, shard_identity(job.replicas))
    _tombstone(job, owners, key)
    assert _record(job, owners) is None

    group_b = f"{job.group}-b"
    run = job.run(_config(job, owners, "b.toml", checkpoint="fresh-b"), "--group", group_b)
    line = refused(run, "already stores rows", f"{job.database}.orders",
                   f"--topic {job.topic}:", "--to-offset", "--take-over GROUP")
    print(line)
    assert _committed(job, group_b) == {}
    job.assert_exactly_once()

    # the group that delivered them claims the topic, even stopped (kill -9) between
    # inserting its last blocks and its next commit: that commit lists the blocks
    # (resume offset at their start, rows stored up to their end), which it replays
    # identically; it delivers anew only after them
    _back_to_last_intent(job)
    job.produce(10)
    _delivered(job, _config(job, owners, "a2.toml", checkpoint="fresh-a"))
    job.assert_exactly_once()
    assert _record(job, owners).owner == job.group


def _back_to_last_intent(job: Job) -> None:
    """Each partition's commit set back to its last intent that lists blocks, as a
    kill -9 after their inserts leaves it (the blocks' rows are stored)."""
    from confluent_kafka import Consumer, TopicPartition

    from blockagg.aggregator.core.metadata import decode
    from blockagg.verifier.history import HistoryReader
    from blockagg.verifier.rules import Commit

    with HistoryReader(job.bootstrap, [job.group], [job.topic]) as reader:
        history = [e for e in reader.events() if isinstance(e, Commit)]
    intents = {c.partition: (c.offset, text) for c in history
               if (text := c.metadata.rstrip("\x00")).startswith("ba")
               and decode(text).blocks}
    assert intents, "no commit listed blocks"
    consumer = Consumer({"bootstrap.servers": job.bootstrap, "group.id": job.group})
    try:
        consumer.commit(offsets=[TopicPartition(job.topic, p, offset, text)
                                 for p, (offset, text) in intents.items()],
                        asynchronous=False)
    finally:
        consumer.close()


def _tombstone(job: Job, owners: str, key: ClaimKey) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": job.bootstrap})
    producer.produce(owners, key=key.encode(), value=None)
    assert producer.flush(10) == 0


def test_two_groups_claiming_at_once_cannot_both_win(job: Job) -> None:
    """Eight starts of eight groups at the same instant (threads, the check alone, no
    Spark): exactly one claims the topic; the other seven are refused naming it."""
    owners = _owners_topic()
    path = _config(job, owners)
    config = load(path, {})
    topics = {job.topic: 2}
    results: dict[str, str] = {}
    barrier = threading.Barrier(8)

    def start(group: str) -> None:
        mine = load(path, {"job.metadata_group_id": group})
        barrier.wait(60)
        try:
            [decision] = ownership.check(mine, topics, clickhouse=True)
            results[group] = decision.kind
        except TopicOwned as exc:
            results[group] = f"refused: {exc}"

    threads = [threading.Thread(target=start, args=(f"{config.job.metadata_group_id}-{i}",))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [g for g, r in results.items() if r == "claim"]
    assert len(results) == 8 and len(winners) == 1, results
    assert _record(job, owners).owner == winners[0]
    for group, result in results.items():
        if group != winners[0]:
            assert f"by group '{winners[0]}'" in result, result


def test_arv_reports_a_group_delivering_a_topic_another_group_owns(job: Job) -> None:
    """Group B's commits of A's topic (B ran before ownership existed, or with an old
    version): arv verify --group B and arv audit --group B exit 1 naming the owner."""
    from confluent_kafka import Consumer, TopicPartition

    owners = _owners_topic()
    _delivered(job, _config(job, owners))
    group_b = f"{job.group}-b"
    consumer = Consumer({"bootstrap.servers": job.bootstrap, "group.id": group_b})
    try:
        consumer.commit(offsets=[TopicPartition(job.topic, 0, 3)], asynchronous=False)
    finally:
        consumer.close()
    verify = CliRunner().invoke(arv, ["verify", "--bootstrap-servers", job.bootstrap,
                                      "--group", group_b, "--owners-topic", owners])
    print(verify.stdout)
    assert verify.exit_code == 1, verify.stdout + verify.stderr
    assert f"which group {job.group} delivers into shard" in verify.stdout
    assert "1 ownership conflicts" in verify.stderr
    audit = CliRunner().invoke(arv, [
        "audit", "--bootstrap-servers", job.bootstrap, "--group", group_b, "--topic",
        job.topic, "--clickhouse", job.replicas[0], "--database", job.database,
        "--dead-letter-table", f"{job.database}.dead_letters", "--owners-topic", owners])
    assert audit.exit_code == 1, audit.stdout + audit.stderr
    assert f"which group {job.group} delivers into shard" in audit.stdout
    clean = CliRunner().invoke(arv, ["verify", "--bootstrap-servers", job.bootstrap,
                                     "--group", job.group, "--owners-topic", owners])
    assert clean.exit_code == 0, clean.stdout + clean.stderr
