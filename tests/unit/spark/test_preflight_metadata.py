"""The metadata budget at start (issue 28 item 5): an intent listing every registered
table at the configured batch range must fit ``offset.metadata.max.bytes``, and the
brokers' limit must not be below the job's; otherwise the start is refused naming the
settings and the value to set, before anything is committed."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.metadata import (
    BlockRange,
    DedupMode,
    Metadata,
    Pins,
    budget_refusal,
    encode,
    worst_case_length,
)
from blockagg.aggregator.kafka.exceptions import MetadataBudgetTooSmall
from blockagg.config import loads
from blockagg.spark.preflight import check_metadata_budget


def config(max_offsets: int | None, max_bytes: int = 4096):  # type: ignore[no-untyped-def]
    job = f"max_offsets_per_trigger = {max_offsets}\n" if max_offsets else ""
    return loads(f"""
[job]
checkpoint_location = "/tmp/ck"
offset_metadata_max_bytes = {max_bytes}
{job}[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "orders"
replicas = ["ch:9000"]
""")


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.data())
def test_no_intent_is_longer_than_the_worst_case(data: st.DataObject) -> None:
    ids = sorted(data.draw(st.sets(st.integers(0, 10_000), min_size=1, max_size=2_000)))
    span = data.draw(st.integers(1, 2**40))
    start = data.draw(st.integers(0, 2**62))
    listed = data.draw(st.sets(st.sampled_from(ids), max_size=len(ids)))
    blocks = []
    for t in sorted(listed):
        first = data.draw(st.integers(start, start + span - 1))
        blocks.append(BlockRange(t, first, data.draw(st.integers(first, start + span - 1))))
    metadata = Metadata(data.draw(st.integers(0, 2**64 - 1)), 10**9, start, start + span,
                        start, tuple(blocks),
                        Pins(2**40, 2**64 - 1, DedupMode.BLOCK_HASH, 2**40),
                        data.draw(st.integers(0, 2**32 - 1)), data.draw(st.integers(0, 2**40 - 1)))
    assert len(encode(metadata, max_bytes=1 << 30)) <= worst_case_length(ids, span)


def test_1000_tables_at_a_million_offsets_fit_the_default() -> None:
    assert worst_case_length(range(1_001), 1_000_000) <= 4095
    assert budget_refusal(list(range(1_001)), 1_000_000, 4096, 4096) is None


def test_5000_tables_refuse_the_start_naming_the_settings_and_the_value() -> None:
    need = worst_case_length(list(range(5_001)), 1_000_000)
    with pytest.raises(MetadataBudgetTooSmall) as caught:
        check_metadata_budget(config(1_000_000), range(1, 5_001), 4096)
    message = str(caught.value)
    assert f"needs up to {need} bytes" in message
    assert f"offset.metadata.max.bytes >= {need + 1}" in message
    assert f"offset_metadata_max_bytes = {need + 1}" in message
    check_metadata_budget(config(1_000_000, need + 1), range(1, 5_001), need + 1)


def test_a_broker_limit_below_the_jobs_refuses_the_start() -> None:
    with pytest.raises(MetadataBudgetTooSmall,
                       match=r"offset\.metadata\.max\.bytes is 4096, below the job's "
                             r"offset_metadata_max_bytes = 16384"):
        check_metadata_budget(config(None, 16_384), range(1, 10), 4096)
    check_metadata_budget(config(None, 16_384), range(1, 10), None)


def test_without_a_batch_bound_an_oversized_budget_is_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check_metadata_budget(config(None), range(1, 5_001), 4096)
    assert "max_offsets_per_trigger" in caplog.text


def test_the_limit_counts_the_clients_nul() -> None:
    need = worst_case_length(list(range(3_001)), 10_000)
    assert budget_refusal(list(range(3_001)), 10_000, need + 1, None) is None
    assert budget_refusal(list(range(3_001)), 10_000, need, None) is not None


def test_running_md_shows_the_refusal_line() -> None:
    from pathlib import Path

    line = budget_refusal(list(range(5_001)), 1_000_000, 4096, 4096)
    assert line is not None
    assert f"\n{line}\n" in (Path(__file__).parents[3] / "docs" / "running.md").read_text()
