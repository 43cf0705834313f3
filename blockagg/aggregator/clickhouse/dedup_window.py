"""Each partition's share of a table's deduplication window, and which topics share a shard.

A replayed block is dropped by ClickHouse only while its first attempt is still among
the table's last ``W_t`` blocks (``replicated_deduplication_window``, or
``non_replicated_deduplication_window`` on 22+). Let ``P`` be the number of
partitions of every topic whose replicas are the table's shard (any of them may write
any registered table, and all of them feed the dead-letter table), and
``S_t = floor(W_t / (2 x P))`` the table's **share** per partition-batch.

*Proof that a replay stays in the window.* Between a block's first attempt and its
replay at most ``BATCHES_IN_FLIGHT = 2`` batches insert into the table (the batch whose
block failed and the one that replays it: a task retry runs inside the batch, a
restart replays before any new batch). In each of them each of the ``P`` partitions
forms at most ``S_t`` blocks of the table, because ``plan_batch`` refuses a
partition-batch that forms more (``TooManyBlocks``, counting every block formed:
replays, and seals by rows, bytes and the batch's end), before anything of it is
committed or inserted; a retry of a partition-batch rebuilds the same blocks, which the
server drops, adding nothing. So at most ``2 x P x S_t <= W_t`` blocks reach the table
in that time, and the replay is still in the window. Nothing here bounds the rows or
bytes of a message, the messages of a batch or the tables of an envelope: the guard
counts the blocks actually formed, so no assumption about them is needed.

Start-up: a table with ``S_t < 1`` (a window below ``2 x P``) could hold no block at
all and is refused (``DedupWindowTooSmall``) unless
``clickhouse.allow_small_dedup_window`` (then the table has no guard, with a warning).
A window that holds fewer blocks than the configuration's batches are expected to form
per partition (:attr:`DedupNeed.expected_blocks`) is only warned about: such batches
will be refused by the guard, and the operator sizes ahead.

``P`` must count every partition writing the shard, whatever the spelling of each
topic's replica list (``127.0.0.1:19000`` or ``localhost:19000``, ``[r1, r2]`` or
``[r2]``): :func:`shard_partitions` groups topics that share a replica address or the
identity the servers give for the shard (:meth:`ClickHouseBlockWriter.shard_identity`).
Grouping two shards together only lowers the shares (safe); splitting one would not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall
from blockagg.aggregator.core.model import BATCHES_IN_FLIGHT, BlockShare

if TYPE_CHECKING:
    from blockagg.config import Config

__all__ = ["BATCHES_IN_FLIGHT", "BlockShare", "DedupNeed", "DedupWindow", "expected_blocks",
           "judge_window", "replica_keys", "shard_partitions", "shares"]


@dataclass(frozen=True, slots=True)
class DedupWindow:
    """A table's deduplication window as the server reports it."""

    setting: str
    """``replicated_deduplication_window`` or ``non_replicated_deduplication_window``."""
    blocks: int


@dataclass(frozen=True, slots=True)
class DedupNeed:
    """What a shard asks of each table's window: ``partitions`` (``P``) write it."""

    partitions: int
    expected_blocks: int | None = None
    """Blocks of one table a partition-batch is expected to form under the
    configuration (:func:`expected_blocks`): a share below it is warned about."""
    batches_in_flight: int = BATCHES_IN_FLIGHT

    @property
    def minimum(self) -> int:
        """The smallest window holding one block per partition-batch: ``2 x P``."""
        return self.batches_in_flight * max(self.partitions, 1)

    def share(self, window: int) -> int:
        """``S_t``: the blocks of the table one partition-batch may form."""
        return window // self.minimum

    def explain(self, window: int) -> str:
        return (f"share = floor({window} / ({self.batches_in_flight} batches in flight x "
                f"{self.partitions} partitions on the shard)) = {self.share(window)} blocks "
                "per partition-batch")


def expected_blocks(config: Config) -> int | None:
    """Blocks of one table a partition-batch forms when it receives a whole batch of
    one-row messages: ``ceil(max_offsets_per_trigger / max_rows)`` seals by rows plus
    the batch's end. ``None`` when batches are unbounded. Only for the sizing warning:
    messages of many rows or bytes form more, which the guard refuses."""
    limit = config.job.max_offsets_per_trigger
    if limit is None:
        return None
    return 1 + math.ceil(limit / config.blocks.max_rows)


def judge_window(table: str, setting: str, window: int, need: DedupNeed,
                 allow_small: bool) -> str | None:
    """``None`` when ``window`` gives each partition-batch a share of at least one
    block (and at least ``need.expected_blocks``); a share of 0 raises
    :class:`DedupWindowTooSmall` naming the table, the window and ``P``, or, with
    ``allow_small`` (``clickhouse.allow_small_dedup_window``), returns it as a warning
    (the table then has no guard); a share below the expected blocks returns a
    warning."""
    share = need.share(window)
    if share >= 1:
        expected = need.expected_blocks
        if expected is None or share >= expected:
            return None
        return (f"table {table}: {setting} = {window} holds {share} blocks per "
                f"partition-batch ({need.explain(window)}), below the {expected} a batch "
                "of job.max_offsets_per_trigger one-row messages forms: such batches will be "
                f"refused (TooManyBlocks); size it to at least {need.minimum * expected}")
    message = (
        f"table {table}: {setting} = {window} is below the {need.minimum} blocks "
        f"({need.batches_in_flight} batches in flight x {need.partitions} partitions on the "
        "shard, one block per partition-batch) a replay may have to outlive: a replayed "
        f"block could land twice. Raise it to at least {need.minimum} (more to let a "
        "partition-batch form several blocks: each gets floor(window / "
        f"{need.minimum})) via the table's SETTINGS, ALTER TABLE {table} MODIFY SETTING "
        "on 19.x+, or <merge_tree> in config.xml; clickhouse.allow_small_dedup_window = "
        "true starts without the guard")
    if allow_small:
        return message
    raise DedupWindowTooSmall(message)


def shard_partitions(keys: Mapping[str, Iterable[str]],
                     partitions: Mapping[str, int]) -> dict[str, int]:
    """``P`` for each topic configuration of ``keys``: the partitions of every topic
    configuration on the same shard. ``keys[label]`` are what identifies its shard
    (normalised replica addresses, the servers' shard identity); two configurations
    sharing any key are one shard (a replica belongs to one shard), transitively.
    ``partitions[label]``: the partitions the job reads through that configuration."""
    parent = {label: label for label in keys}

    def root(label: str) -> str:
        while parent[label] != label:
            parent[label] = parent[parent[label]]
            label = parent[label]
        return label

    owner: dict[str, str] = {}
    for label, its_keys in keys.items():
        for key in its_keys:
            if key in owner:
                parent[root(label)] = root(owner[key])
            else:
                owner[key] = label
    total: dict[str, int] = {}
    for label in keys:
        total[root(label)] = total.get(root(label), 0) + partitions.get(label, 0)
    return {label: total[root(label)] for label in keys}


def shares(windows: Mapping[int, DedupWindow], partitions: int) -> tuple[BlockShare, ...]:
    """The guard's shares (``Thresholds.max_blocks_per_table``) for tables by id."""
    return tuple(BlockShare(table_id, window.blocks, partitions)
                 for table_id, window in sorted(windows.items()))


def replica_keys(replicas: Iterable[object],
                 resolve: Callable[[str, int], Iterable[str]] | None = None) -> frozenset[str]:
    """Keys naming each of ``replicas`` (``host:port``) whatever its spelling: every
    address its host resolves to, with the port (``localhost:19000`` and
    ``127.0.0.1:19000`` share ``127.0.0.1:19000``); the lower-cased name when it does
    not resolve. For :func:`shard_partitions`."""
    look_up = resolve or _addresses
    keys: set[str] = set()
    for replica in replicas:
        host, port = str(getattr(replica, "host", "")), int(getattr(replica, "port", 0))
        try:
            found = {f"address:{a}:{port}" for a in look_up(host, port)}
        except OSError:
            found = set()
        keys |= found or {f"host:{host.lower()}:{port}"}
    return frozenset(keys)


def _addresses(host: str, port: int) -> list[str]:
    import socket

    return sorted({str(info[4][0]) for info in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)})
