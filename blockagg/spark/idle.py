"""Keeping quiet partitions' commits alive.

The metadata group commits without members, so the broker expires each partition's
committed offset ``offsets.retention.minutes`` (7 days by default) after its last
commit. A partition that receives no message for that long would lose its commit, and
a restart without a Spark checkpoint would then start it at ``starting_offsets``
(earliest: duplicates; latest: loss). So the driver re-commits every partition whose
last commit is older than ``job.idle_commit_interval`` with its offset and metadata
unchanged but for the attempt nonce (:func:`with_attempt`): commits the verifier reads
as identical (a client retry looks the same), which move nothing.

Race-free by construction: the driver re-commits only partitions no task of the
current batch touches (between batches, with the batch lock held, or at the start of a
batch for partitions outside its planned ranges), so a re-commit never lands after a
newer commit of the same partition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Final

from blockagg.aggregator.core.exceptions import MetadataError
from blockagg.aggregator.core.metadata import (
    CLIENT_TERMINATOR_BYTES,
    decode,
    encode,
    is_blockagg,
)
from blockagg.aggregator.core.model import MetadataStore
from blockagg.exceptions import ConfigError
from blockagg.spark.components import open_attempt
from blockagg.spark.offsets import TopicPartition

RETENTION_KEY: Final = "offsets.retention.minutes"
START_GRACE_S: Final = 300.0
"""How long after start a partition whose commit's age is unknown waits for its first
re-commit (at most ``job.idle_commit_interval``). Kafka's offset API does not return
commit times, so the driver cannot tell a commit made a minute before a restart from one
made six days before; re-committing every partition at once on every start would repeat
commits that the first batches make anyway. Within the grace, the first batch commits
each partition that has messages (:meth:`IdleRefresher.saw_commit`), and only the
partitions still not seen committed are re-committed when it ends. The grace only
delays a refresh by minutes against a retention of days (at least four intervals)."""
REFRESHES_PER_RETENTION: Final = 4
"""At least this many re-commits fit in the brokers' retention: one missed (a stopped
job, a slow batch) still leaves three."""


def check_idle_interval(interval_s: float, retention_minutes: int) -> None:
    """Refuse an ``idle_commit_interval`` that does not fit
    :data:`REFRESHES_PER_RETENTION` times in the brokers' ``offsets.retention.minutes``."""
    limit = retention_minutes * 60 / REFRESHES_PER_RETENTION
    if interval_s > limit:
        raise ConfigError(
            f"job.idle_commit_interval = {interval_s:g}s is too long for the brokers' "
            f"{RETENTION_KEY} = {retention_minutes} ({retention_minutes / 60:g} h): a quiet "
            "partition's commit would expire before it is renewed. Set it to at most "
            f"{limit:g}s (a quarter of the retention)")


def broker_retention_minutes(admin: Any, timeout: float = 10.0) -> int | None:
    """``offsets.retention.minutes`` of the first broker that answers (they must agree),
    or ``None`` when the cluster does not say (no DescribeConfigs permission, or no
    broker answered)."""
    from blockagg.aggregator.kafka.broker_config import read_broker_config

    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        _, settings = read_broker_config(admin, brokers, timeout)
        return int(settings[RETENTION_KEY])
    except Exception:
        return None


def with_attempt(text: str, nonce: int) -> str:
    """``text`` re-encoded as written by the attempt ``nonce``, everything else the same
    (the verifier reads the same metadata), in version 3 (``ba3:``), never longer than
    ``text``: nonces all encode to five bytes, and a base85 string's body is shorter in
    base32768. Foreign or undecodable text, and text the re-encoding would lengthen,
    stay unchanged."""
    if not is_blockagg(text):
        return text
    try:
        return encode(replace(decode(text), attempt=nonce),
                      max_bytes=len(text) + CLIENT_TERMINATOR_BYTES)
    except MetadataError:
        return text


class IdleRefresher:
    """Which partitions are due a re-commit, and the re-commit itself.

    ``last`` is when each partition was last committed as far as the driver knows: by a
    task (``saw_commit``) or by a re-commit. A partition the driver has not seen
    committed in this run has a commit of unknown age: it is due once
    ``min(interval, start_grace_s)`` after start (:data:`START_GRACE_S`), unless a
    task commits it first."""

    def __init__(self, interval_s: float, clock: Callable[[], float],
                 start_grace_s: float = START_GRACE_S) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[TopicPartition, float] = {}
        self._unknown_due = clock() + min(interval_s, start_grace_s)
        self.recommitted = 0

    def unknown_age(self, partitions: Iterable[TopicPartition]) -> list[TopicPartition]:
        """The partitions not seen committed in this run (their commit's age unknown)."""
        return sorted(tp for tp in partitions if tp not in self._last)

    def saw_commit(self, tp: TopicPartition) -> None:
        self._last[tp] = self._clock()

    def due(self, partitions: Iterable[TopicPartition],
            busy: Mapping[TopicPartition, object] | None = None) -> list[TopicPartition]:
        """The partitions whose last known commit is older than the interval, and, once
        the start grace is over, those of unknown age; except those in ``busy`` (the
        current batch's tasks commit them)."""
        now = self._clock()

        def is_due(tp: TopicPartition) -> bool:
            last = self._last.get(tp)
            return now >= self._unknown_due if last is None else now - last >= self.interval_s

        return sorted(tp for tp in partitions if (busy is None or tp not in busy) and is_due(tp))

    def refresh(self, store: MetadataStore, partitions: Iterable[TopicPartition]) -> int:
        """Re-commit each partition's committed offset and metadata (under this
        attempt's nonce); returns how many were re-committed (a partition without a
        commit has nothing to keep).

        Each re-commit is a fenced attempt of its own, like a task's: it fences any older
        attempt at the partition before reading the commit it repeats, so a stalled task
        can't commit after it and the repeated commit can't land behind a newer one. It
        repeats blockagg metadata under its own attempt's nonce (:func:`with_attempt`),
        so a stalled task whose intent it repeats fails its next confirm instead of
        taking the repeat for its own commit."""
        count = 0
        for tp in partitions:
            attempt = open_attempt(store, tp[0], tp[1])
            try:
                fenced: MetadataStore = attempt or store
                committed = fenced.committed(*tp)
                if committed is not None:
                    text = committed.metadata
                    if attempt is not None:
                        text = with_attempt(text, attempt.nonce)
                    fenced.commit(tp[0], tp[1], committed.offset, text)
                    count += 1
            finally:
                if attempt is not None:
                    attempt.close()
            self._last[tp] = self._clock()
        self.recommitted += count
        return count
