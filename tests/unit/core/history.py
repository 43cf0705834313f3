"""The verifier's rules of ``docs/metadata.md``, applied to an in-memory commit
history: the oracle the protocol tests hold every history to."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from blockagg.aggregator.core.metadata import Metadata


def anomalies(history: Sequence[Metadata]) -> list[str]:
    """Backward, Overlap and Gap anomalies between consecutive commits, plus breaches
    of invariant 5 (every listed block starts at or after the resume offset)."""
    found: list[str] = []
    for index, metadata in enumerate(history):
        for block in metadata.blocks:
            if block.first < metadata.resume:
                found.append(f"Invariant5 at {index}: {block} starts below {metadata.resume}")
    for index, (before, after) in enumerate(pairwise(history), start=1):
        if after.resume < before.resume:
            found.append(f"Backward at {index}: resume {before.resume} -> {after.resume}")
        if after.start > before.resume:
            found.append(f"Gap at {index}: start {after.start} > resume {before.resume}")
        for block in before.blocks:
            other = after.block_of(block.table_id)
            if other is None:
                if block.last >= after.resume:
                    found.append(f"Gap at {index}: {block} forgotten, resume {after.resume}")
                continue
            if other.last < block.first:
                found.append(f"Backward at {index}: {block} -> {other}")
            elif other != block and other.overlaps(block):
                found.append(f"Overlap at {index}: {block} and {other}")
    return found
