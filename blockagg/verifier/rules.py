"""The anomaly rules: pure checks over one group/topic/partition's commit history.

A history is the sequence of offset commits of one consumer group for one topic-partition,
in commit order. Commits written by blockagg carry :class:`~aggregator.core.metadata.Metadata`
(``docs/metadata.md``); the rules compare each one, M', with the blockagg metadata
committed right before it, M (``M.t`` is table ``t``'s block in M):

``backward``
    M' rewinds: ``M'.resume < M.resume``, or for a table listed in both,
    ``M'.t.last < M.t.first``.
``overlap``
    A table has two *different* blocks in M and M' that share an offset. The same block
    in both is a replay and is fine.
``gap``
    M' starts its batch past M's resume offset (``M'.start > M.resume``): the offsets
    ``[M.resume, M'.start)`` were never confirmed delivered and will not be read again;
    or a block of M reaching ``M'.resume`` (``last >= M'.resume``) has no block of its
    table in M': its messages at or above ``M'.resume`` are neither delivered nor
    tracked; or (on M' alone) a block of M' starts below ``M'.resume``, so a restart
    cannot rebuild it. These rules compare batch boundaries, resume offsets and block
    listings, never message counts, so offset holes (transaction markers, aborted
    records), which lie inside batch ranges, never raise them.

and each commit on its own for:

``offset_mismatch``
    The committed offset differs from the metadata's resume offset (blockagg never
    commits that: a tool moved the offset and kept the metadata). Above it, a restart
    skips ``[resume, offset)``; below it, it re-reads delivered offsets. Like a reset,
    it replaces M: the aggregator resumes from the committed offset without replay
    (``docs/protocol.md``), so the next commit is checked against that offset only.
``undecodable``
    The metadata carries blockagg's prefix but does not decode; the commit is otherwise
    ignored (M stays the last good metadata).
``foreign_writer``
    A *notice*, not an anomaly: the metadata is not blockagg's, so someone else committed
    for the group (an operator's ``kafka-consumer-groups --reset-offsets``, which
    ``docs/metadata.md`` calls a Reset, or another application sharing the group id).
    It replaces M: the next blockagg commit M' is not compared with the metadata before
    the reset for backward/overlap but with the reset's offset F: a gap if ``M'.start``
    is above F (the core refuses such a batch), backward (an anomaly) if ``M'.resume``
    or a block of M' goes below F (blockagg resumes exactly at the committed offset, so
    a rewind under a reset is never the operator's doing). ``M'.start`` below F is
    fine: a Spark checkpoint behind a forward reset plans the batch from its old
    position, and the core leaves the messages below F out as delivered, consuming
    exactly from F (``check_after_reset``).
``past_end``
    The commit claims offsets beyond the partition's high watermark (the committed
    offset, or the batch end). A commit pinned to an earlier incarnation of the topic
    (deleted and recreated since) is not judged against the new topic's watermark.

Tombstones (deleted or expired group offsets) are counted and change no state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from blockagg.aggregator.core.exceptions import MetadataDecodeError
from blockagg.aggregator.core.metadata import Metadata, decode, is_blockagg


class AnomalyKind(StrEnum):
    """What went wrong; the value is the stable name used in JSON and metrics."""

    BACKWARD = "backward"
    OVERLAP = "overlap"
    GAP = "gap"
    OFFSET_MISMATCH = "offset_mismatch"
    UNDECODABLE = "undecodable"
    FOREIGN_WRITER = "foreign_writer"
    PAST_END = "past_end"

    @property
    def is_notice(self) -> bool:
        """True for kinds reported for information, which don't fail a run by default."""
        return self is AnomalyKind.FOREIGN_WRITER


@dataclass(frozen=True, slots=True)
class Commit:
    """One offset commit of ``group`` for ``topic``/``partition``, as read back.

    ``commit_timestamp`` is in milliseconds (the coordinator's clock).
    ``coordinator_partition``/``coordinator_offset`` locate the record in
    ``__consumer_offsets`` (-1 when unknown, e.g. in tests).
    """

    group: str
    topic: str
    partition: int
    offset: int
    metadata: str
    commit_timestamp: int
    coordinator_partition: int = -1
    coordinator_offset: int = -1


@dataclass(frozen=True, slots=True)
class Finding:
    """One rule's verdict on a pair or a commit, before it is tied to a commit."""

    kind: AnomalyKind
    detail: str
    table_id: int | None = None


@dataclass(frozen=True, slots=True)
class Anomaly:
    """An anomaly found at ``current``'s commit.

    ``previous`` is the last blockagg metadata before it (``None`` for the first commit
    seen); ``current`` is ``None`` when the commit's metadata is not blockagg's or does
    not decode, in which case ``raw_metadata`` holds the string as committed.
    """

    kind: AnomalyKind
    group: str
    topic: str
    partition: int
    commit_timestamp: int
    offset: int
    previous: Metadata | None
    current: Metadata | None
    detail: str
    table_id: int | None = None
    previous_commit_timestamp: int | None = None
    raw_metadata: str | None = None
    coordinator_partition: int = -1
    coordinator_offset: int = -1

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view; metadata instances become objects, blocks ``[table, first, last]``."""
        return {
            "kind": self.kind.value,
            "group": self.group,
            "topic": self.topic,
            "partition": self.partition,
            "commit_timestamp_ms": self.commit_timestamp,
            "offset": self.offset,
            "table_id": self.table_id,
            "detail": self.detail,
            "previous": metadata_as_dict(self.previous),
            "previous_commit_timestamp_ms": self.previous_commit_timestamp,
            "current": metadata_as_dict(self.current),
            "raw_metadata": self.raw_metadata,
            "coordinator_partition": self.coordinator_partition,
            "coordinator_offset": self.coordinator_offset,
        }


def metadata_as_dict(metadata: Metadata | None) -> dict[str, Any] | None:
    """``metadata`` as a JSON-ready object, ``None`` stays ``None``."""
    if metadata is None:
        return None
    return {
        "run": metadata.run,
        "batch": metadata.batch,
        "start": metadata.start,
        "end": metadata.end,
        "resume": metadata.resume,
        "blocks": [[b.table_id, b.first, b.last] for b in metadata.blocks],
    }


def check_pair(previous: Metadata, current: Metadata) -> list[Finding]:
    """Backward, overlap and gap findings for consecutive blockagg metadata M, M'."""
    findings: list[Finding] = []
    if current.resume < previous.resume:
        findings.append(Finding(
            AnomalyKind.BACKWARD,
            f"resume offset went back from {previous.resume} to {current.resume}: "
            f"delivered offsets [{current.resume}, {previous.resume}) will be consumed again",
        ))
    for block in current.blocks:
        before = previous.block_of(block.table_id)
        if before is None or before == block:
            continue
        if block.last < before.first:
            findings.append(Finding(
                AnomalyKind.BACKWARD,
                f"table {block.table_id}: block [{block.first}, {block.last}] ends before "
                f"the previous block [{before.first}, {before.last}] starts",
                block.table_id,
            ))
        elif block.overlaps(before):
            findings.append(Finding(
                AnomalyKind.OVERLAP,
                f"table {block.table_id}: block [{block.first}, {block.last}] overlaps the "
                f"different previous block [{before.first}, {before.last}]; the shared "
                "offsets may be inserted twice",
                block.table_id,
            ))
    findings.extend(check_start(previous.resume, current))
    for before in previous.blocks:
        if before.last >= current.resume and current.block_of(before.table_id) is None:
            findings.append(Finding(
                AnomalyKind.GAP,
                f"table {before.table_id}: block [{before.first}, {before.last}] of the "
                f"previous commit reaches the new resume offset {current.resume} but the "
                "table has no block any more: its offsets at or above "
                f"{current.resume} are neither delivered nor tracked",
                before.table_id,
            ))
    return findings


def check_start(resume: int, current: Metadata) -> list[Finding]:
    """The batch-boundary gap: ``current`` must start at or below the previous ``resume``.

    ``resume`` is the previous blockagg metadata's resume offset, or the offset of a
    foreign commit (a reset) that came after it.
    """
    if current.start <= resume:
        return []
    return [Finding(
        AnomalyKind.GAP,
        f"batch starts at {current.start} but the previous resume offset was "
        f"{resume}: offsets [{resume}, {current.start}) were skipped",
    )]


def check_after_reset(reset: int, current: Metadata) -> list[Finding]:
    """After a foreign commit (a reset to ``reset``) or an offset mismatch, blockagg
    resumes from the committed offset: it consumes exactly from there, with no blocks
    to replay.

    Judged by what ``current`` delivers, its resume offset and blocks, never by
    ``current.start`` alone: a Spark checkpoint behind a forward reset plans the
    batch from below ``reset``, and the core leaves the messages in
    ``[start, reset)`` out as delivered (the operator acknowledged them), so a batch
    starting below the reset whose resume offset and blocks are at or above it
    neither loses nor duplicates anything. A resume offset below ``reset`` or a block
    starting below it consumes acknowledged offsets again: backward, an anomaly, not
    a notice (no operator asked for it). Starting past ``reset`` is a gap
    (:func:`check_start`): the core refuses such a batch.
    """
    findings = check_start(reset, current)
    if current.resume < reset:
        findings.append(Finding(
            AnomalyKind.BACKWARD,
            f"resume offset {current.resume} is below the offset {reset} the group was "
            f"reset to: offsets [{current.resume}, {reset}) are consumed again",
        ))
    findings.extend(
        Finding(
            AnomalyKind.BACKWARD,
            f"table {b.table_id}: block [{b.first}, {b.last}] starts below the offset "
            f"{reset} the group was reset to: offsets [{b.first}, {min(b.last + 1, reset)}) "
            "are formed into a block again",
            b.table_id,
        )
        for b in current.blocks
        if b.first < reset
    )
    return findings


def check_blocks(metadata: Metadata) -> list[Finding]:
    """Invariant 5 of ``docs/metadata.md``: every listed block starts at or after resume.

    A block starting below the resume offset cannot be rebuilt by a consumer resuming
    there; if it was not inserted, its messages below resume are lost (a gap).
    """
    return [
        Finding(
            AnomalyKind.GAP,
            f"table {b.table_id}: block [{b.first}, {b.last}] starts below the resume "
            f"offset {metadata.resume}: a restart cannot rebuild it, so its offsets "
            f"[{b.first}, {metadata.resume}) are lost unless it was inserted",
            b.table_id,
        )
        for b in metadata.blocks
        if b.first < metadata.resume
    ]


def check_offset(offset: int, metadata: Metadata) -> list[Finding]:
    """The offset-mismatch finding: the committed offset must equal ``metadata.resume``."""
    if offset == metadata.resume:
        return []
    if offset > metadata.resume:
        effect = (f"a restart from the group's offset skips [{metadata.resume}, {offset})")
    else:
        effect = (f"a restart from the group's offset re-reads delivered offsets "
                  f"[{offset}, {metadata.resume})")
    return [Finding(
        AnomalyKind.OFFSET_MISMATCH,
        f"committed offset {offset} differs from the metadata's resume offset "
        f"{metadata.resume}: {effect}",
    )]


def check_end(offset: int, metadata: Metadata | None, high_watermark: int) -> list[Finding]:
    """The past-end finding: nothing a commit claims may lie beyond ``high_watermark``."""
    claimed = offset if metadata is None else max(offset, metadata.end)
    if claimed <= high_watermark:
        return []
    what = "committed offset" if metadata is None or offset >= metadata.end else "batch end"
    return [Finding(
        AnomalyKind.PAST_END,
        f"{what} {claimed} is past the partition's high watermark {high_watermark}",
    )]


HighWatermark = Callable[[str, int, int], int | None]
"""``(topic, partition, claimed)`` to the partition's high watermark, ``None`` if unknown.

``claimed`` is the largest offset the commit claims; an implementation may use it to
refresh a cached value that is below it before answering.
"""


@dataclass(slots=True)
class _Last:
    metadata: Metadata | None
    resume: int
    commit_timestamp: int


class Verifier:
    """Feeds commits of many group/topic/partitions through the rules, in commit order.

    :meth:`observe` must be called, per group/topic/partition, in commit order; histories
    of different partitions may interleave freely. State per partition: the last
    blockagg metadata, or the offset of a foreign commit (a reset) that followed it.
    """

    def __init__(self, high_watermark: HighWatermark | None = None,
                 incarnation: Callable[[str, int], int | None] | None = None) -> None:
        """``incarnation(topic, seen)``: the topic's current incarnation (``None``:
        unknown), asked again when a commit names ``seen``, another than the last
        answer (a topic recreated while following)."""
        self._high_watermark = high_watermark
        self._incarnation = incarnation
        self._last: dict[tuple[str, str, int], _Last] = {}
        self.commits_checked = 0
        self.tombstones = 0

    def observe(self, commit: Commit) -> list[Anomaly]:
        """Check ``commit`` against its partition's previous commit; see the module doc."""
        self.commits_checked += 1
        key = (commit.group, commit.topic, commit.partition)
        last = self._last.get(key)
        previous = last.metadata if last else None
        text = commit.metadata.rstrip("\x00")
        current: Metadata | None = None
        findings: list[Finding] = []
        raw: str | None = None
        if not is_blockagg(text):
            raw = commit.metadata
            findings.append(Finding(
                AnomalyKind.FOREIGN_WRITER,
                f"commit of offset {commit.offset} carries no blockagg metadata "
                f"(metadata {_short(commit.metadata)!r}): a reset by an operator or "
                "another application using the group id",
            ))
            self._last[key] = _Last(None, commit.offset, commit.commit_timestamp)
        else:
            try:
                current = decode(text)
            except MetadataDecodeError as exc:
                raw = commit.metadata
                findings.append(Finding(AnomalyKind.UNDECODABLE, str(exc)))
        if current is not None:
            mismatch = check_offset(commit.offset, current)
            findings.extend(mismatch)
            findings.extend(check_blocks(current))
            if previous is not None:
                findings.extend(check_pair(previous, current))
            elif last is not None:
                findings.extend(check_after_reset(last.resume, current))
            if mismatch:
                self._last[key] = _Last(None, commit.offset, commit.commit_timestamp)
            else:
                self._last[key] = _Last(current, current.resume, commit.commit_timestamp)
        if self._high_watermark is not None and not self._earlier_incarnation(
                commit.topic, current):
            claimed = commit.offset if current is None else max(commit.offset, current.end)
            end = self._high_watermark(commit.topic, commit.partition, claimed)
            if end is not None:
                findings.extend(check_end(commit.offset, current, end))
        return [
            Anomaly(
                kind=f.kind,
                group=commit.group,
                topic=commit.topic,
                partition=commit.partition,
                commit_timestamp=commit.commit_timestamp,
                offset=commit.offset,
                previous=previous,
                current=current,
                detail=f.detail,
                table_id=f.table_id,
                previous_commit_timestamp=last.commit_timestamp if last else None,
                raw_metadata=raw,
                coordinator_partition=commit.coordinator_partition,
                coordinator_offset=commit.coordinator_offset,
            )
            for f in findings
        ]

    def _earlier_incarnation(self, topic: str, metadata: Metadata | None) -> bool:
        """Whether ``metadata`` is pinned to another incarnation of ``topic`` than the
        one the cluster holds now: its offsets are the deleted topic's."""
        pinned = metadata.pins.incarnation if metadata is not None else 0
        if not pinned or self._incarnation is None:
            return False
        now = self._incarnation(topic, pinned)
        return now is not None and now != pinned

    def observe_tombstone(self, group: str, topic: str, partition: int) -> None:
        """Count a deleted offset; the partition's state is kept (see module doc)."""
        del group, topic, partition
        self.tombstones += 1

    @property
    def partitions(self) -> int:
        """How many group/topic/partitions have been seen so far."""
        return len(self._last)


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:60] + "..."
