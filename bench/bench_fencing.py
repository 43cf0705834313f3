"""Fenced vs plain metadata commits: ``python -m bench.bench_fencing [--repeat R]``.

Fencing (``blockagg.aggregator.kafka.fencing``) makes every metadata commit a
transaction of a per-partition transactional id, opens each task attempt with
``init_transactions()``, and confirms the partition's last commit before each insert.
This measures what that adds to the Kafka side of the protocol, against the broker of
``scripts/stack`` (``BLOCKAGG_BOOTSTRAP_SERVERS`` or ``bench.workload.stack_env``):

* **per commit**: ``KafkaMetadataStore.commit`` (a plain group-less offset commit, the
  baseline) vs ``FencedAttempt.commit`` (begin, ``send_offsets_to_transaction``,
  commit), the same offsets and metadata;
* **per batch**: the Kafka work of one partition's batch of ``--blocks`` blocks, one seal
  event each, without the ClickHouse inserts themselves. Plain: read the last commit,
  then per block an intent, then the final commit. Fenced: open the attempt (producer +
  ``init_transactions``), read, then per block an intent and a confirm, then the final.
  Batches are ``--gap`` seconds apart (untimed), as micro-batches are at least a
  trigger apart: an ``init_transactions`` right after the previous transaction's end
  often waits for its markers.

* **per batch, producer kept**: the fenced batch, but each attempt takes the
  partition's producer kept by the previous one (``fencing.IdleProducers``, as a Python
  worker does across batches) and shows it still holds the newest epoch with one
  aborted transaction, instead of starting a producer and calling
  ``init_transactions()``.

Plain and fenced alternate within one run, ABBA (plain, fenced, fenced, plain, ...),
each round on a fresh group and topic partition, so both see the same broker and load;
the kept-producer batches alternate with the fresh-producer ones the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

from bench.workload import create_topic, stack_env
from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.aggregator.kafka.fencing import FencedAttempt, IdleProducers
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore


def _texts(n: int, tables: int = 20) -> list[tuple[int, str]]:
    """Intent-sized metadata strings (``tables`` listed blocks) and their offsets."""
    out = []
    for i in range(n):
        resume = 1000 * i
        blocks = tuple(BlockRange(t + 1, resume + t, resume + 900 + t) for t in range(tables))
        out.append((resume, encode(Metadata(7, i, resume, resume + 1000, resume, blocks))))
    return out


def _store(bootstrap: str) -> KafkaMetadataStore:
    return KafkaMetadataStore({"bootstrap.servers": bootstrap,
                               "group.id": f"fencebench-{uuid.uuid4().hex[:8]}"})


def commits_plain(bootstrap: str, topic: str, texts: list[tuple[int, str]]) -> list[float]:
    with _store(bootstrap) as store:
        store.commit(topic, 0, 0, "warm-up")
        out = []
        for offset, text in texts:
            started = time.perf_counter()
            store.commit(topic, 0, offset, text)
            out.append(time.perf_counter() - started)
        return out


def commits_fenced(bootstrap: str, topic: str, texts: list[tuple[int, str]]) -> list[float]:
    with _store(bootstrap) as store, FencedAttempt(store, topic, 0) as attempt:
        attempt.commit(topic, 0, 0, "warm-up")
        out = []
        for offset, text in texts:
            started = time.perf_counter()
            attempt.commit(topic, 0, offset, text)
            out.append(time.perf_counter() - started)
        return out


def batches_plain(bootstrap: str, topic: str, batches: int, blocks: int,
                  gap: float) -> list[float]:
    texts = _texts(blocks + 1)
    with _store(bootstrap) as store:
        store.commit(topic, 0, 0, "warm-up")
        out = []
        for _ in range(batches):
            time.sleep(gap)
            started = time.perf_counter()
            store.committed(topic, 0)
            for offset, text in texts:
                store.commit(topic, 0, offset, text)
            out.append(time.perf_counter() - started)
        return out


def batches_fenced(bootstrap: str, topic: str, batches: int, blocks: int,
                   gap: float, keep: bool = False) -> list[float]:
    texts = _texts(blocks + 1)
    idle = IdleProducers() if keep else None
    with _store(bootstrap) as store:
        with FencedAttempt(store, topic, 0, idle=idle) as warm:
            warm.commit(topic, 0, 0, "warm-up")
        out = []
        for _ in range(batches):
            time.sleep(gap)
            started = time.perf_counter()
            with FencedAttempt(store, topic, 0, idle=idle) as attempt:
                assert attempt.reused == keep
                attempt.committed(topic, 0)
                for index, (offset, text) in enumerate(texts):
                    attempt.commit(topic, 0, offset, text)
                    if index < blocks:
                        attempt.confirm(topic, 0)
            out.append(time.perf_counter() - started)
        return out


def _abba(rounds: int, plain: Callable[[], list[float]],
          fenced: Callable[[], list[float]]) -> tuple[list[float], list[float]]:
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        for which in ("ab" if r % 2 == 0 else "ba"):
            (a if which == "a" else b).extend(plain() if which == "a" else fenced())
    return a, b


def _row(name: str, plain: list[float], fenced: list[float]) -> str:
    p, f = statistics.median(plain) * 1e3, statistics.median(fenced) * 1e3
    p90 = statistics.quantiles(plain, n=10)[-1] * 1e3
    f90 = statistics.quantiles(fenced, n=10)[-1] * 1e3
    return (f"| {name} | {p:.2f} ({p90:.2f}) | {f:.2f} ({f90:.2f}) | {f / p:.2f}x |"
            f" {len(plain)} / {len(fenced)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=4, help="rounds; even numbers keep ABBA")
    ap.add_argument("--commits", type=int, default=100, help="commits timed per round")
    ap.add_argument("--batches", type=int, default=10, help="batches timed per round")
    ap.add_argument("--blocks", type=int, default=4, help="blocks (seal events) per batch")
    ap.add_argument("--gap", type=float, default=0.2,
                    help="seconds between batches, untimed (a trigger interval's pause)")
    args = ap.parse_args(argv)
    bootstrap = os.environ.get("BLOCKAGG_BOOTSTRAP_SERVERS") or stack_env()[
        "BLOCKAGG_BOOTSTRAP_SERVERS"]
    topic = f"fencebench-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 1)
    texts = _texts(args.commits)
    print(f"commits={args.commits} batches={args.batches} blocks={args.blocks} "
          f"gap={args.gap}s repeat={args.repeat} metadata={len(texts[-1][1])} bytes",
          file=sys.stderr)
    per_commit = _abba(args.repeat, lambda: commits_plain(bootstrap, topic, texts),
                       lambda: commits_fenced(bootstrap, topic, texts))
    per_batch = _abba(args.repeat,
                      lambda: batches_plain(bootstrap, topic, args.batches, args.blocks,
                                            args.gap),
                      lambda: batches_fenced(bootstrap, topic, args.batches, args.blocks,
                                             args.gap))
    print("| measured | plain, median (p90) ms | fenced, median (p90) ms | fenced / plain "
          "| samples |")
    print("| --- | --- | --- | --- | --- |")
    print(_row("one metadata commit", *per_commit))
    print(_row(f"one batch's Kafka work ({args.blocks} blocks)", *per_batch))
    kept = _abba(args.repeat,
                 lambda: batches_fenced(bootstrap, topic, args.batches, args.blocks, args.gap),
                 lambda: batches_fenced(bootstrap, topic, args.batches, args.blocks, args.gap,
                                        keep=True))
    print("\n| measured | fenced, fresh producer, median (p90) ms | fenced, producer kept, "
          "median (p90) ms | kept / fresh | samples |")
    print("| --- | --- | --- | --- | --- |")
    print(_row(f"one batch's Kafka work ({args.blocks} blocks)", *kept))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
