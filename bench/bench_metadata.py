"""Metadata size at many tables (issue 28 item 5): characters of one intent, as the
broker counts them against ``offset.metadata.max.bytes`` (4096 by default, 4095 for
the string), old format (base85, ``ba2:``) vs new (base32768, ``ba3:``).

``python3 -m bench.bench_metadata`` prints a table of tables x batch range -> characters.
Workloads: *interleaved* (tables' messages interleaved through the batch, so each
block starts near the resume offset and ends near the end of the range; every 50th
table absent), *worst* (every block's ends anywhere in the range: the bound the
start-up check uses, :func:`blockagg.aggregator.core.metadata.worst_case_length`).
"""

from __future__ import annotations

import random

from blockagg.aggregator.core.metadata import (
    BlockRange,
    DedupMode,
    Metadata,
    Pins,
    encode,
    encode_base85,
)

TABLES = (10, 100, 500, 1_000, 2_000)
RANGES = (10_000, 100_000, 1_000_000)
PINS = Pins(registry=2**40, incarnation=2**64 - 1, dedup=DedupMode.BLOCK_HASH,
            structure=2**40)
START = 7_000_000_000


def interleaved(tables: int, span: int, rng: random.Random) -> Metadata:
    """Messages of the present tables drawn uniformly through the range: each table's
    block runs from its first message to its last."""
    present = [t for t in range(1, tables + 1) if t % 50]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for offset in range(START, START + span):
        t = present[rng.randrange(len(present))]
        first.setdefault(t, offset)
        last[t] = offset
    blocks = tuple(BlockRange(t, first[t], last[t]) for t in first)
    return Metadata(2**64 - 1, 10**9, START, START + span, START, blocks, PINS,
                    attempt=2**32 - 1, since_s=2**35)


def worst(tables: int, span: int, rng: random.Random) -> Metadata:
    blocks = []
    for t in range(1, tables + 1):
        a, b = sorted(rng.randrange(START, START + span) for _ in range(2))
        blocks.append(BlockRange(t, a, b))
    return Metadata(2**64 - 1, 10**9, START, START + span, START, tuple(blocks), PINS,
                    attempt=2**32 - 1, since_s=2**35)


def main() -> None:
    rng = random.Random(28)
    print(f"{'workload':<12}{'tables':>7}{'range':>10}{'base85':>9}{'b32768':>9}  fits 4095")
    for name, make in (("interleaved", interleaved), ("worst", worst)):
        for span in RANGES:
            for tables in TABLES:
                metadata = make(tables, span, rng)
                old = len(encode_base85(metadata, max_bytes=1 << 30))
                new = len(encode(metadata, max_bytes=1 << 30))
                print(f"{name:<12}{tables:>7}{span:>10}{old:>9}{new:>9}  "
                      f"{'yes' if new <= 4095 else 'NO'}")


if __name__ == "__main__":
    main()
