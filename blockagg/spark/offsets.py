"""Offsets on the driver: where the query starts, and each micro-batch's planned range.

**Start.** Without a Spark checkpoint (first run, or a lost checkpoint) the query
starts every partition at the resume offset committed in the metadata group, and a
partition without a commit at the configured default; :func:`starting_offsets_json`
builds Spark's ``startingOffsets`` JSON for that. With a checkpoint Spark ignores
``startingOffsets`` and resumes from its own offset log, which the protocol then
checks against the committed metadata (a start above the resume offset is refused).

**Planned range.** The rows of a micro-batch don't tell where its range ends: the
range may end in (or consist only of) offsets without a visible record (transaction
markers, aborted records). Spark writes the planned end offsets of batch ``N`` to
``<checkpoint>/offsets/N`` *before* running it (the offset log is Spark's write-ahead
log), and the start is the end of batch ``N-1`` in the same log, or, for the first
batch of a new checkpoint, the source's resolved initial offsets in
``<checkpoint>/sources/0/0``. :class:`OffsetLog` reads both through Hadoop's
FileSystem API in the driver's JVM, so HDFS, S3A and local checkpoints all work.

File formats (Spark 4.0, checked by ``tests/integration/test_job_offsets.py``)::

    offsets/N:   "v1\\n" + batch metadata JSON + "\\n" + one line per source:
                 the source's offset JSON, {"topic": {"0": 6, "1": 0}}
    sources/0/0: "\\x00v1\\n" + {"topic": {"0": 0, "1": 0}}
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from blockagg import logs
from blockagg.aggregator.core.model import Committed
from blockagg.spark.exceptions import OffsetLogError

TopicPartition = tuple[str, int]

EARLIEST: Final = -2
LATEST: Final = -1
_SUPPORTED_LOG_VERSIONS: Final = ("v1",)


@dataclass(frozen=True, slots=True)
class PlannedRange:
    """One partition's planned ``[start, end)`` in one micro-batch.

    ``exact_start`` is False when the start was not in the offset log (a partition
    that appeared during the query: Spark reads it from its earliest offset); the
    start is then the partition's log-start offset as the driver saw it, and a task
    lowers it to its first row if Spark read from further down.
    """

    topic: str
    partition: int
    start: int
    end: int
    exact_start: bool = True

    @property
    def empty(self) -> bool:
        return self.end <= self.start


def _source_offsets(obj: object, where: str) -> dict[TopicPartition, int]:
    if not isinstance(obj, dict):
        raise OffsetLogError(f"{where}: expected a Kafka source offset object, got {obj!r:.200}")
    out: dict[TopicPartition, int] = {}
    for topic, partitions in obj.items():
        if not isinstance(partitions, dict):
            raise OffsetLogError(f"{where}: topic {topic!r} has no partition map: {obj!r:.200}")
        for partition, offset in partitions.items():
            if not isinstance(offset, int) or not str(partition).lstrip("-").isdigit():
                raise OffsetLogError(
                    f"{where}: bad offset {offset!r} for {topic}[{partition}]"
                )
            out[(str(topic), int(partition))] = offset
    return out


def parse_offset_log_entry(text: str, where: str = "offset log entry") -> dict[
        TopicPartition, int]:
    """The Kafka source's end offsets from one ``offsets/N`` file.

    The job has exactly one source, so the entry has one offset line after the batch
    metadata; a checkpoint of a query with another shape is refused.
    """
    lines = text.split("\n")
    version = lines[0].strip().lstrip("\x00")
    if version not in _SUPPORTED_LOG_VERSIONS:
        raise OffsetLogError(
            f"{where}: offset log version {version!r} is not supported (known: "
            f"{', '.join(_SUPPORTED_LOG_VERSIONS)}); this Spark version writes a new format"
        )
    body = [line for line in lines[2:] if line.strip()]
    if len(body) != 1:
        raise OffsetLogError(
            f"{where}: expected exactly one source (the Kafka source) in the offset log, "
            f"found {len(body)}: the checkpoint belongs to another query; point "
            "job.checkpoint_location at a directory of its own"
        )
    line = body[0].strip()
    if line in ("-", "null"):
        return {}
    try:
        parsed = json.loads(line)
    except json.JSONDecodeError as exc:
        raise OffsetLogError(f"{where}: the source offset is not JSON: {line!r:.200}") from exc
    return _source_offsets(parsed, where)


def parse_initial_offsets(text: str, where: str = "initial offsets") -> dict[
        TopicPartition, int]:
    """The resolved initial offsets the Kafka source wrote to ``sources/0/0``."""
    lines = text.lstrip("\x00").split("\n", 1)
    if lines[0].strip() not in _SUPPORTED_LOG_VERSIONS or len(lines) != 2:
        raise OffsetLogError(f"{where}: unexpected format {text[:80]!r}")
    try:
        parsed = json.loads(lines[1])
    except json.JSONDecodeError as exc:
        raise OffsetLogError(f"{where}: not JSON: {lines[1][:200]!r}") from exc
    return _source_offsets(parsed, where)


def plan_ranges(
    end: Mapping[TopicPartition, int],
    previous: Mapping[TopicPartition, int] | None,
    earliest: Mapping[TopicPartition, int] | None = None,
) -> dict[TopicPartition, PlannedRange]:
    """Planned ranges from a batch's end offsets and the previous end offsets.

    A partition missing from ``previous`` started at its earliest offset (Spark's rule
    for new partitions): ``earliest`` gives it when known, else 0.
    """
    ranges: dict[TopicPartition, PlannedRange] = {}
    for tp, stop in sorted(end.items()):
        if previous is not None and tp in previous:
            start, exact = previous[tp], True
        else:
            start, exact = (earliest or {}).get(tp, 0), False
        if start > stop:
            raise OffsetLogError(
                f"{tp[0]}[{tp[1]}]: the offset log plans [{start}, {stop}), which goes "
                "backwards: the topic was recreated or the checkpoint belongs to another "
                "cluster; delete job.checkpoint_location (safe: the job restarts from the "
                "committed metadata)"
            )
        ranges[tp] = PlannedRange(tp[0], tp[1], start, stop, exact)
    return ranges


class OffsetLog:
    """Reads a streaming query's offset log through Hadoop's FileSystem (driver only).

    The Java classes it uses are looked up once: Py4J resolves a dotted name such as
    ``jvm.org.apache.hadoop.fs.Path`` one segment at a time, each a round trip in which
    the JVM first tries the segment as a class, through every jar on Spark's class
    path (docs/BENCHMARKS.md, "1 KiB rows, the driver's progress poll, and the JVM's
    share of a warm batch")."""

    def __init__(self, spark: Any, checkpoint: str) -> None:
        jvm = spark.sparkContext._jvm
        self._path_class = jvm.org.apache.hadoop.fs.Path
        self._io_utils = jvm.org.apache.commons.io.IOUtils
        self._conf = spark.sparkContext._jsc.hadoopConfiguration()
        self._root = self._path_class(checkpoint)
        self._fs = self._root.getFileSystem(self._conf)
        self.checkpoint = checkpoint

    def _path(self, *parts: str) -> Any:
        path = self._root
        for part in parts:
            path = self._path_class(path, part)
        return path

    def _read(self, *parts: str) -> str | None:
        path = self._path(*parts)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            text: str = self._io_utils.toString(stream, "UTF-8")
        finally:
            stream.close()
        return text

    def batch_ids(self) -> list[int]:
        """The batch ids present in ``offsets/`` (ascending)."""
        path = self._path("offsets")
        if not self._fs.exists(path):
            return []
        ids = []
        for status in self._fs.listStatus(path):
            name = status.getPath().getName()
            if re.fullmatch(r"\d+", name):
                ids.append(int(name))
        return sorted(ids)

    def has_offsets(self) -> bool:
        """True when the checkpoint has an offset log (Spark will resume from it)."""
        return bool(self.batch_ids())

    def end_offsets(self, batch_id: int) -> dict[TopicPartition, int] | None:
        text = self._read("offsets", str(batch_id))
        if text is None:
            return None
        return parse_offset_log_entry(text, f"{self.checkpoint}/offsets/{batch_id}")

    def initial_offsets(self) -> dict[TopicPartition, int] | None:
        text = self._read("sources", "0", "0")
        if text is None:
            return None
        return parse_initial_offsets(text, f"{self.checkpoint}/sources/0/0")

    def planned_ranges(
        self, batch_id: int, earliest: Mapping[TopicPartition, int] | None = None
    ) -> dict[TopicPartition, PlannedRange]:
        """Batch ``batch_id``'s planned range per partition.

        Raises :class:`OffsetLogError` when the batch is not in the log (it always is:
        Spark writes it before running the batch) or the log is unreadable.
        """
        end = self.end_offsets(batch_id)
        if end is None:
            raise OffsetLogError(
                f"{self.checkpoint}/offsets/{batch_id} does not exist while batch {batch_id} "
                "runs: is job.checkpoint_location the query's checkpoint, and is "
                "asynchronous progress tracking off?"
            )
        previous = self.end_offsets(batch_id - 1) if batch_id > 0 else None
        if previous is None:
            previous = self.initial_offsets()
        if previous is None:
            raise OffsetLogError(
                f"{self.checkpoint}: neither offsets/{batch_id - 1} nor sources/0/0 exists, so "
                f"batch {batch_id}'s start is unknown; the offset log was purged or edited. "
                "Delete the checkpoint directory (safe: the job restarts from the committed "
                "metadata)"
            )
        return plan_ranges(end, previous, earliest)


def starting_offsets_json(
    partitions: Iterable[TopicPartition],
    resume: Mapping[TopicPartition, int],
    default: Literal["earliest", "latest"],
) -> str:
    """Spark's ``startingOffsets``: the resume offset of every partition that has one,
    ``-2`` (earliest) or ``-1`` (latest) for the others. Every partition of every
    subscribed topic must be listed (Spark refuses a partial map)."""
    fallback = EARLIEST if default == "earliest" else LATEST
    out: dict[str, dict[str, int]] = {}
    for topic, partition in sorted(partitions):
        out.setdefault(topic, {})[str(partition)] = resume.get((topic, partition), fallback)
    return json.dumps(out, separators=(",", ":"), sort_keys=True)


def offsets_json(offsets: Mapping[TopicPartition, int]) -> str:
    """``{"topic": {"0": 12}}`` for Spark's specific offsets options."""
    out: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[str(partition)] = offset
    return json.dumps(out, separators=(",", ":"), sort_keys=True)


def assign_json(partitions: Iterable[TopicPartition]) -> str:
    """Spark's ``assign`` option: ``{"topic": [0, 1]}``."""
    out: dict[str, list[int]] = {}
    for topic, partition in sorted(partitions):
        out.setdefault(topic, []).append(partition)
    return json.dumps(out, separators=(",", ":"), sort_keys=True)


# --------------------------------------------------------------------------- Kafka


def _raise_config(exc: Exception) -> None:
    from blockagg.exceptions import ConfigError

    text = str(exc)
    if "No such configuration property" in text or "Invalid value" in text:
        raise ConfigError(f"kafka / kafka.librdkafka: librdkafka refuses a key: {text}") from exc


def make_consumer(config: Mapping[str, str], group_id: str) -> Any:
    """A confluent-kafka consumer that never joins its group (commits and reads of
    committed offsets only), with the job's owned settings."""
    from confluent_kafka import Consumer, KafkaException

    conf: dict[str, object] = dict(config)
    conf.update(
        {
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        return Consumer(logs.kafka_client_config(conf))
    except KafkaException as exc:
        _raise_config(exc)
        raise


def list_partitions(
    consumer: Any, matches: Any, timeout: float = 30.0
) -> list[TopicPartition]:
    """Every partition of every topic for which ``matches(topic)`` is true."""
    metadata = consumer.list_topics(timeout=timeout)
    out: list[TopicPartition] = []
    for name, topic in metadata.topics.items():
        if name.startswith("__") or not matches(name):
            continue
        if topic.error is not None:
            raise OffsetLogError(f"topic {name}: {topic.error}")
        out.extend((name, p) for p in topic.partitions)
    return sorted(out)


def read_committed(
    consumer: Any, partitions: Iterable[TopicPartition], timeout: float = 30.0
) -> dict[TopicPartition, Committed]:
    """The metadata group's commits (offset and metadata) for ``partitions``."""
    from confluent_kafka import TopicPartition as KTP

    wanted = [KTP(t, p) for t, p in partitions]
    if not wanted:
        return {}
    out: dict[TopicPartition, Committed] = {}
    for tp in consumer.committed(wanted, timeout=timeout):
        if tp.error is not None:
            raise OffsetLogError(f"reading the committed offset of {tp.topic}[{tp.partition}]: "
                                 f"{tp.error}")
        if tp.offset >= 0:
            out[(tp.topic, tp.partition)] = Committed(tp.offset, tp.metadata or "")
    return out


def watermarks(
    consumer: Any, partitions: Iterable[TopicPartition], timeout: float = 10.0
) -> dict[TopicPartition, tuple[int, int]]:
    """``(low, high)`` watermark offsets per partition (high = log end)."""
    from confluent_kafka import TopicPartition as KTP

    out: dict[TopicPartition, tuple[int, int]] = {}
    for topic, partition in partitions:
        low, high = consumer.get_watermark_offsets(KTP(topic, partition), timeout=timeout)
        out[(topic, partition)] = (int(low), int(high))
    return out
