"""Support for the job's integration tests (``test_job_*.py``).

:class:`FileComponents` runs the real job (real Kafka source, real metadata store,
real offset log) with a *file* sink that behaves like ClickHouse's block
deduplication: every insert appends one JSON line with the block's token and content,
and :func:`stored` keeps the first insert of each token (checking that every retry of
a token carried the identical block, which is the determinism invariant). It lets
the job's own mechanics (planned ranges, empty ranges, restarts, lost checkpoints,
task retries) be tested exactly, independently of the ClickHouse writer. Selected in a
``spark-submit`` run with ``BLOCKAGG_COMPONENTS=tests.integration.job_support:from_env``.

Environment of the job process: ``BLOCKAGG_TEST_SINK`` (the JSONL path),
``BLOCKAGG_TEST_TABLES`` (``db.a=1,db.b=2``), ``BLOCKAGG_TEST_FAIL_ONCE`` (a marker
path: the first insert of the whole run fails, once, to make Spark retry the task).

:class:`PauseComponents` (``BLOCKAGG_COMPONENTS=tests.integration.job_support:pause_from_env``,
``BLOCKAGG_TEST_PAUSE_DIR``) keeps the real adapters and holds the first block insert
after the test arms it, so a test can kill the job between a batch's metadata commit
and its insert (``test_job_clickhouse.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockagg.aggregator.core.model import Batch, Block, BlockSink, MetadataStore
from blockagg.config import Config, TopicConfig
from blockagg.rows.deadletters import DeadLetter
from blockagg.spark.components import DefaultComponents, StaticRegistry, TableRegistry


class InjectedFailure(RuntimeError):
    pass


class FileSink:
    def __init__(self, path: str, fail_once: str | None) -> None:
        self.path = path
        self.fail_once = fail_once

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        if self.fail_once:
            try:
                fd = os.open(self.fail_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                raise InjectedFailure(f"injected failure before inserting {block.token}")
        items = []
        for pos in block.positions.tolist():
            payload = batch.payloads[pos]
            offset = int(batch.offsets[pos])
            if isinstance(payload, DeadLetter):
                items.append([offset, payload.error[:60]])
            else:
                items.append([offset, [r.decode() for r in payload.parsed.rows]])
        line = json.dumps({"token": block.token, "table": block.table, "topic": block.topic,
                           "partition": block.partition, "replay": block.replay,
                           "at": time.time(), "items": items}) + "\n"
        with open(self.path, "a", encoding="utf-8") as out:
            fcntl.flock(out, fcntl.LOCK_EX)
            out.write(line)
            out.flush()
            fcntl.flock(out, fcntl.LOCK_UN)


@dataclass(frozen=True)
class FileComponents:
    sink_path: str
    tables: tuple[tuple[str, int], ...]
    fail_once: str | None = None

    def store(self, config: Config) -> MetadataStore:
        return DefaultComponents().store(config)

    def sink(self, config: Config, topic: TopicConfig) -> BlockSink:
        return FileSink(self.sink_path, self.fail_once)

    def registry(self, config: Config) -> TableRegistry:
        return StaticRegistry(dict(self.tables))


def from_env() -> FileComponents:
    tables = tuple(
        (name, int(i))
        for name, _, i in (item.partition("=")
                           for item in os.environ["BLOCKAGG_TEST_TABLES"].split(",") if item)
    )
    return FileComponents(os.environ["BLOCKAGG_TEST_SINK"], tables,
                          os.environ.get("BLOCKAGG_TEST_FAIL_ONCE") or None)


@dataclass
class Stored:
    """What the deduplicating file sink holds: per table, ``(topic, partition, offset)
    -> rows`` of every message, plus the count of inserts dropped as duplicates."""

    rows: dict[str, dict[tuple[str, int, int], Any]]
    inserts: int
    duplicates: int
    replays: int


def stored(path: str | Path) -> Stored:
    blocks: dict[str, dict[str, Any]] = {}
    inserts = duplicates = replays = 0
    p = Path(path)
    lines = p.read_text().splitlines() if p.exists() else []
    for line in lines:
        block = json.loads(line)
        inserts += 1
        replays += bool(block["replay"])
        first = blocks.get(block["token"])
        if first is not None:
            duplicates += 1
            assert first["items"] == block["items"], (
                f"block {block['token']} was inserted twice with different content: "
                "retries are not deterministic"
            )
            continue
        blocks[block["token"]] = block
    rows: dict[str, dict[tuple[str, int, int], Any]] = defaultdict(dict)
    for block in blocks.values():
        for offset, content in block["items"]:
            key = (block["topic"], block["partition"], offset)
            assert key not in rows[block["table"]], (
                f"{key} of {block['table']} is in two different blocks: duplicated"
            )
            rows[block["table"]][key] = content
    return Stored(dict(rows), inserts, duplicates, replays)


# --------------------------------------------------------------------------- pause hook

class PausingSink:
    """The real sink, except that once ``<pause dir>/armed`` exists the first block
    insert of the run (over every worker process) stops *before* sending the block:
    it claims ``paused`` (``O_EXCL``, holding its pid) and sleeps until
    ``<pause dir>/release`` appears. The metadata commit announcing the block is
    already made (intent before flush), so a test that kills the job now leaves an
    interrupted batch for the next run to REPLAY."""

    def __init__(self, inner: BlockSink, folder: str) -> None:
        self.inner = inner
        self.folder = Path(folder)

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        if (self.folder / "armed").exists():
            try:
                fd = os.open(self.folder / "paused", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, f"{os.getpid()} {block.token}\n".encode())
                os.close(fd)
                deadline = time.monotonic() + 300
                while not (self.folder / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        self.inner.insert(block, batch, confirmed_at)


@dataclass(frozen=True)
class PauseComponents:
    """The production adapters with :class:`PausingSink` around the shard's writer.
    ``BLOCKAGG_COMPONENTS=tests.integration.job_support:pause_from_env`` with
    ``BLOCKAGG_TEST_PAUSE_DIR``."""

    folder: str

    def store(self, config: Config) -> MetadataStore:
        return DefaultComponents().store(config)

    def sink(self, config: Config, topic: TopicConfig) -> BlockSink:
        return PausingSink(DefaultComponents().sink(config, topic), self.folder)

    def registry(self, config: Config) -> TableRegistry:
        return DefaultComponents().registry(config)


def pause_from_env() -> PauseComponents:
    return PauseComponents(os.environ["BLOCKAGG_TEST_PAUSE_DIR"])
