"""Core benchmark: ``python -m bench.bench_core [--messages N] [--tables T] [--append]``.

Routing + sealing of one partition's batch of small messages over many tables:
:func:`aggregator.core.blocks.form_blocks` (columnar) against
:func:`aggregator.core.blocks.form_blocks_per_message` (the plain per-message loop),
same batch, same run, one core; both must form the same blocks. Also the whole plan
(formation, intents and their encoding) and the metadata codec for 500 tables.
``--append`` writes the result to ``docs/BENCHMARKS.md`` under ``## Core``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from blockagg.aggregator.core.blocks import Formation, form_blocks, form_blocks_per_message
from blockagg.aggregator.core.metadata import BlockRange, Metadata, decode, encode
from blockagg.aggregator.core.model import Batch, Thresholds
from blockagg.aggregator.core.protocol import plan_batch

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
HEADING = "## Core"

T = TypeVar("T")


def make_batch(messages: int, tables: int, seed: int = 11) -> Batch:
    """``messages`` small messages (1-4 rows, ~60 bytes a row) spread over ``tables``
    tables, with an offset hole (a transaction marker) every 1000 offsets."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(messages, dtype=np.int64)
    offsets += offsets // 999
    table_ids = rng.integers(1, tables + 1, size=messages, dtype=np.int64)
    rows = rng.integers(1, 5, size=messages, dtype=np.int64)
    sizes = rows * 60 + rng.integers(0, 20, size=messages, dtype=np.int64)
    start = 1_000_000_000
    return Batch(
        topic="bench",
        partition=0,
        start=start,
        end=start + int(offsets[-1]) + 1 if messages else start,
        offsets=offsets + start,
        table_ids=table_ids,
        row_counts=rows,
        sizes=sizes,
        payloads=[None] * messages,
        tables={t: f"db.table_{t}" for t in range(1, tables + 1)},
    )


def best_of(repeat: int, work: Callable[[], T]) -> tuple[float, T]:
    best = float("inf")
    result: T | None = None
    for _ in range(repeat):
        began = time.perf_counter()
        result = work()
        best = min(best, time.perf_counter() - began)
    assert result is not None
    return best, result


def block_list(formation: Formation) -> list[tuple[int, int, int, int, int]]:
    return [(b.table_id, b.first, b.last, b.rows, b.size) for b in formation.blocks]


def codec_figures(tables: int, repeat: int) -> tuple[float, float, int]:
    """Encode and decode of the end-of-batch intent of a 100k-offset batch listing
    ``tables`` tables: microseconds each (best of ``repeat`` x 200) and the size."""
    start, end = 5_000_000_000, 5_000_100_000
    blocks = tuple(
        BlockRange(t, start + 100 * t, end - 1 - 30 * t) for t in range(1, tables + 1)
    )
    metadata = Metadata(2**63 + 5, 123_456, start, end, start + 100, blocks)
    text = encode(metadata)
    assert decode(text) == metadata
    loops = 200
    encode_s, _ = best_of(repeat, lambda: [encode(metadata) for _ in range(loops)])
    decode_s, _ = best_of(repeat, lambda: [decode(text) for _ in range(loops)])
    return encode_s / loops * 1e6, decode_s / loops * 1e6, len(text)


def run(messages: int, tables: int, max_rows: int, max_bytes: int, repeat: int) -> str:
    batch = make_batch(messages, tables)
    thresholds = Thresholds(max_rows=max_rows, max_bytes=max_bytes)
    columnar_s, columnar = best_of(
        repeat, lambda: form_blocks(batch, batch.start, {}, thresholds)
    )
    loop_s, reference = best_of(
        max(1, repeat // 2), lambda: form_blocks_per_message(batch, batch.start, {}, thresholds)
    )
    if block_list(columnar) != block_list(reference) or columnar.sealed_at != reference.sealed_at:
        raise SystemExit("columnar and per-message formation disagree: this is a bug")
    plan_s, plan = best_of(repeat, lambda: plan_batch(batch, None, thresholds, 1, 1))
    encode_us, decode_us, size = codec_figures(500, repeat)
    blocks = len(columnar.blocks)
    return "\n".join(
        [
            f"messages={messages:,} tables={tables} max_rows={max_rows:,} "
            f"max_bytes={max_bytes:,} blocks={blocks:,} commits={len(plan.operations) - blocks}",
            f"per-message loop:   {messages / loop_s:>12,.0f} msg/s ({loop_s * 1e3:,.1f} ms)",
            f"columnar (numpy):   {messages / columnar_s:>12,.0f} msg/s "
            f"({columnar_s * 1e3:,.1f} ms)",
            f"ratio:              {loop_s / columnar_s:.2f}x",
            f"whole plan:         {messages / plan_s:>12,.0f} msg/s ({plan_s * 1e3:,.1f} ms, "
            "formation + intents + encoding)",
            f"metadata, 500 tables: encode {encode_us:,.0f} us, decode {decode_us:,.0f} us, "
            f"{size:,} bytes (limit 4,096)",
        ]
    )


def append(command: str, summary: str) -> None:
    """Replace the ``## Core`` section of docs/BENCHMARKS.md (or add it), leaving the
    other sections alone."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    today = datetime.date.today().isoformat()
    section = (
        f"{HEADING}\n\n`{command}` (Python {platform.python_version()}, numpy "
        f"{np.__version__}, {platform.machine()}, one core, {today})\n\n```\n{summary}\n```\n"
    )
    lines = text.splitlines(keepends=True)
    begin = next((i for i, line in enumerate(lines) if line.strip() == HEADING), None)
    if begin is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        stop = next(
            (i for i in range(begin + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        text = "".join(lines[:begin]) + section + ("\n" + "".join(lines[stop:]) if stop < len(
            lines) else "")
    BENCHMARKS.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_core", description=__doc__)
    parser.add_argument("--messages", type=int, default=10_000_000)
    parser.add_argument("--tables", type=int, default=100)
    parser.add_argument("--max-rows", type=int, default=50_000)
    parser.add_argument("--max-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--append", action="store_true", help="write docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    summary = run(args.messages, args.tables, args.max_rows, args.max_bytes, args.repeat)
    print(summary)
    if args.append:
        command = "python -m bench.bench_core " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        append(command.strip(), summary)


if __name__ == "__main__":
    main()
