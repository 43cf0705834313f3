"""Decode benchmark: ``python -m bench.bench_decode [--rows N] [--repeat R] [--append]``.

Compares :func:`proto.decode.decode_rows` (columnar, numpy lock-step wire decoder)
with the naive loop (``FromString`` per row, then ``getattr`` per field into Python
lists) on the same rows in the same run, on one core, and prints rows/s and the
ratio. ``--append`` adds the result to ``docs/BENCHMARKS.md`` under ``## Decode``.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import Descriptor

from blockagg.proto.decode import decode_rows
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent / "docs" / "BENCHMARKS.md"


def event_descriptor() -> Descriptor:
    return load_descriptor(compile_proto(HERE / "row.proto"), "blockagg.bench.Event")


def make_rows(descriptor: Descriptor, n: int, seed: int = 7) -> list[bytes]:
    """``n`` encoded benchmark rows: realistic sizes, some defaults left out."""
    rng = random.Random(seed)
    cls = message_class(descriptor)
    countries = ["DE", "FR", "US", "JP", "BR", "IN", "", "GB"]
    rows = []
    for i in range(n):
        msg: Any = cls()
        msg.id = 10_000_000_000 + i
        msg.user = rng.randrange(0, 5_000_000)
        msg.delta = rng.randrange(-10_000, 10_000)
        msg.price = rng.random() * 1000
        msg.score = rng.random()
        msg.name = f"user-{rng.randrange(100000)}-event"
        msg.country = rng.choice(countries)
        msg.time.seconds = 1_700_000_000 + i
        msg.time.nanos = rng.randrange(1_000_000_000)
        msg.kind = rng.randrange(4)
        msg.tags.extend(rng.randrange(1 << 40) for _ in range(rng.randrange(5)))
        rows.append(msg.SerializeToString())
    return rows


def naive(descriptor: Descriptor, rows: Sequence[bytes]) -> dict[str, list[Any]]:
    """The baseline: ``FromString`` per row, ``getattr`` per field into lists."""
    cls = message_class(descriptor)
    names = [f.name for f in descriptor.fields]
    columns: dict[str, list[Any]] = {name: [] for name in names}
    appends = [(name, columns[name].append) for name in names]
    from_string = cls.FromString
    for row in rows:
        msg = from_string(row)
        for name, append in appends:
            value = getattr(msg, name)
            if name == "time":
                value = (value.seconds, value.nanos)
            elif name == "tags":
                value = list(value)
            append(value)
    return columns


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--append", action="store_true", help="append to docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    descriptor = event_descriptor()
    rows = make_rows(descriptor, args.rows)
    size = sum(map(len, rows))
    decoded = decode_rows(descriptor, rows)
    assert not decoded.errors, decoded.errors
    t_naive = best_of(lambda: naive(descriptor, rows), args.repeat)
    t_cols = best_of(lambda: decode_rows(descriptor, rows), args.repeat)
    n = args.rows
    ratio = t_naive / t_cols
    lines = [
        f"rows={n} avg_row_bytes={size / n:.1f} repeat={args.repeat} (best of)",
        f"naive FromString+getattr: {n / t_naive:,.0f} rows/s ({t_naive * 1e3:.1f} ms)",
        f"decode_rows (columnar):   {n / t_cols:,.0f} rows/s ({t_cols * 1e3:.1f} ms)",
        f"ratio: {ratio:.2f}x",
    ]
    print("\n".join(lines))
    if args.append:
        _append(lines, args)
    return 0


def _append(lines: list[str], args: argparse.Namespace) -> None:
    from google.protobuf.internal import api_implementation

    command = f"python -m bench.bench_decode --rows {args.rows} --repeat {args.repeat} --append"
    env = (f"Python {platform.python_version()}, protobuf backend "
           f"{api_implementation.Type()}, {platform.machine()}, {time.strftime('%Y-%m-%d')}")
    block = "\n".join([f"`{command}` ({env})", "", "```", *lines, "```", ""])
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    if "## Decode" not in text:
        text = text.rstrip("\n") + "\n\n## Decode\n\n" + block
    else:
        head, _, tail = text.partition("## Decode")
        rest = tail.split("\n## ", 1)
        section = rest[0].rstrip("\n") + "\n\n" + block
        text = head + "## Decode" + section + ("\n## " + rest[1] if len(rest) > 1 else "")
    BENCHMARKS.parent.mkdir(parents=True, exist_ok=True)
    BENCHMARKS.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
